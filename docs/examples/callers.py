"""docs/callers.md: a follow-up workflow with a retry policy, a durable timer, a timeout and
an async action."""

# --8<-- [start:follow_up]
import asyncio
import datetime as dt

from k2b_workflows import Action, Effect, Retry, failed, succeeded, workflow

#: Stands in for the mail provider's log in this example.
OUTBOX: list[tuple[str, str]] = []


class SendReminder(Action):
    name = "reminders.send"
    effect = Effect.IDEMPOTENT  # the provider deduplicates by ctx.effect_key
    # Ten patient tries, 30 s apart at first, at most an hour; an unsubscribed
    # address is final however the provider labels it.
    retry = Retry(
        max_attempts=10,
        backoff=dt.timedelta(seconds=30),
        max_backoff=dt.timedelta(hours=1),
        non_retryable_codes=("UNSUBSCRIBED",),
    )

    def plan(self, ctx, input):
        return succeeded({"planned": True}, summary=f"Remind {input['to']}")

    async def run(self, ctx, input):  # an async client is awaited here (httpx, aiosmtplib, ...)
        await asyncio.sleep(0)
        if input["to"].endswith("@unsubscribed.example"):
            return failed("the address unsubscribed", code="UNSUBSCRIBED", retryable=True)
        OUTBOX.append((ctx.effect_key, input["to"]))
        return succeeded({"message_id": ctx.effect_key})


@workflow("reminders.follow_up", app_id="reminders", timeout=dt.timedelta(days=7))
def follow_up(run, input):
    run.step(SendReminder, {"to": input["to"]})
    run.sleep(dt.timedelta(days=3))  # the run parks: no thread waits three days
    run.step(SendReminder, {"to": input["to"]})
    return {"reminded": 2}
# --8<-- [end:follow_up]


# --8<-- [start:remind_now]
@workflow("reminders.remind_now", app_id="reminders")
def remind_now(run, input):
    return run.step(SendReminder, {"to": input["to"]})
# --8<-- [end:remind_now]
