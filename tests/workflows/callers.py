"""Actions and workflows for retry policies, durable timers, workflow timeouts and async hooks.

Each action records its calls as ``ProviderCall`` rows (committed on their
own, like a provider's log), so a test counts attempts after crashes too.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import threading

from k2b_workflows import Action, Effect, Retry, failed, succeeded, workflow
from tests.models import ProviderCall
from tests.support.workflow_steps import one_step


def calls(name: str) -> int:
    return ProviderCall.objects.filter(action=name).count()


class FlakyUntil(Action):
    """Fails (retryable, code ``input["code"]``) until called ``input["ok_at"]`` times."""

    name = "callers.flaky"
    effect = Effect.PURE

    def run(self, ctx, input):
        ProviderCall.objects.create(action=self.name, effect_key=ctx.effect_key)
        if calls(self.name) < input["ok_at"]:
            return failed("not yet", code=input.get("code"), retryable=True)
        return succeeded({"calls": calls(self.name)})


class PatientFlaky(FlakyUntil):
    """The same, under a policy of its own: eight attempts, an hour apart at first."""

    name = "callers.patient"
    retry = Retry(max_attempts=8, backoff=dt.timedelta(hours=1), max_backoff=dt.timedelta(hours=4))


class OneShot(FlakyUntil):
    """Never retried: a step that must give up after its first failure."""

    name = "callers.one_shot"
    retry = Retry(max_attempts=1)


class OnceOnly(Action):
    """Succeeds, under a policy of one attempt: a crash in it is the end of it."""

    name = "callers.once_only"
    effect = Effect.PURE
    retry = Retry(max_attempts=1)

    def run(self, ctx, input):
        ProviderCall.objects.create(action=self.name, effect_key=ctx.effect_key)
        return succeeded({})


class Declines(FlakyUntil):
    """A retryable failure whose code the policy says is final."""

    name = "callers.declines"
    retry = Retry(max_attempts=5, backoff=0.001, non_retryable_codes=("CARD_DECLINED",))


class Raises(Action):
    """Raises every time: an exception is retryable, under the workflow's policy."""

    name = "callers.raises"
    effect = Effect.PURE

    def run(self, ctx, input):
        ProviderCall.objects.create(action=self.name, effect_key=ctx.effect_key)
        raise RuntimeError("provider down")


RAISED = {
    cls.__name__: cls for cls in (ConnectionError, ConnectionResetError, TimeoutError, ValueError)
}


class Picky(Action):
    """Raises ``input["raise"]`` (a builtin exception's name) until its ``ok_at``-th call:
    retried only for the classes its policy names (``Retry(on=...)``)."""

    name = "callers.picky"
    effect = Effect.IDEMPOTENT
    retry = Retry(max_attempts=4, backoff=0.001, jitter=False, on=(ConnectionError, "TimeoutError"))

    def run(self, ctx, input):
        ProviderCall.objects.create(action=self.name, effect_key=ctx.effect_key)
        if calls(self.name) < input["ok_at"]:
            raise RAISED[input["raise"]]("flaky provider")
        return succeeded({"calls": calls(self.name)})


one_step("callers.flaky", FlakyUntil)
one_step("callers.picky", Picky)
one_step("callers.patient", PatientFlaky)
one_step("callers.one_shot", OneShot)
one_step("callers.once_only", OnceOnly)
one_step("callers.declines", Declines)


@workflow(
    "callers.raises_twice", app_id="tests", retry=Retry(max_attempts=2, backoff=0.001, jitter=False)
)
def raises_twice(run, input):
    return run.step(Raises, {})


@workflow(
    "callers.raises_hourly",
    app_id="tests",
    retry=Retry(max_attempts=3, backoff=dt.timedelta(hours=1), jitter=False),
)
def raises_hourly(run, input):
    """Bounded to 3 attempts an hour apart: only someone who moves ``run_after`` (and
    who may, #47) sees all three before the test ends."""
    return run.step(Raises, {})


@workflow("callers.flaky_then_patient", app_id="tests")
def flaky_then_patient(run, input):
    """Failures before a completed step, then a failure after it: the second step's
    retry writes the first step's success with the reset of its failures (#47)."""
    first = run.step(FlakyUntil, {"ok_at": input["ok_at"]})
    return {"first": first, "second": run.step(PatientFlaky, {"ok_at": 2})}


@workflow(
    "callers.workflow_policy",
    app_id="tests",
    retry=Retry(max_attempts=9, backoff=dt.timedelta(minutes=10)),
)
def workflow_policy(run, input):
    # FlakyUntil has no policy: the workflow's applies; OneShot's own wins over it.
    first = run.step(FlakyUntil, {"ok_at": input["ok_at"]})
    return {"first": first, "second": run.step(OneShot, {"ok_at": 0})}


class Record(Action):
    """Notes that the workflow reached ``input["tag"]`` (one row per call)."""

    name = "callers.record"
    effect = Effect.PURE

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name, effect_key=ctx.effect_key, payload=input["tag"], pid=os.getpid()
        )
        return succeeded({"tag": input["tag"]})


def recorded(tag: str) -> int:
    return ProviderCall.objects.filter(action=Record.name, payload=tag).count()


@workflow("callers.sleeper", app_id="tests")
def sleeper(run, input):
    run.step(Record, {"tag": "before"})
    if "until" in input:
        run.sleep_until(dt.datetime.fromisoformat(input["until"]))
    else:
        run.sleep(dt.timedelta(seconds=input["seconds"]))
    if "flaky_at" in input:
        run.step(FlakyUntil, {"ok_at": input["flaky_at"]})
    run.step(Record, {"tag": "after"})
    return {"slept": True}


@workflow("callers.bad_sleep", app_id="tests")
def bad_sleep(run, input):
    if input["kind"] == "naive":
        run.sleep_until(dt.datetime(2030, 1, 1))
    elif input["kind"] == "zero":
        run.sleep(dt.timedelta(0))
    else:
        run.sleep(5)
    return {}


class BlocksUntilCanceled(Action):
    """An external effect whose provider answers only once the run is canceled (late)."""

    name = "callers.blocks"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name, effect_key=ctx.effect_key, generation=ctx.generation
        )
        ctx.canceled.wait(input.get("block_s", 60))
        return succeeded({"late": True})


class ChargeOnce(Action):
    """An external effect without reconcile(): after a crash, an operator decides."""

    name = "callers.charge_once"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        ProviderCall.objects.create(action=self.name, effect_key=ctx.effect_key)
        return succeeded({"charged": True})


@workflow("callers.timed_gate", app_id="tests", timeout=dt.timedelta(hours=1))
def timed_gate(run, input):
    from tests.workflows.waits import Gate

    return run.step(Gate, {"key": input["key"]})


@workflow("callers.timed_external", app_id="tests", timeout=dt.timedelta(hours=1))
def timed_external(run, input):
    run.step(Record, {"tag": "before"})
    return run.step(BlocksUntilCanceled, {})


@workflow("callers.timed_charge", app_id="tests", timeout=dt.timedelta(hours=1))
def timed_charge(run, input):
    return run.step(ChargeOnce, {})


# -- async def hooks -------------------------------------------------------------------

#: Set by ``AsyncForever`` when its task is cancelled (in-process tests only).
ASYNC_CANCELLED = threading.Event()
#: ``AsyncForever`` has started awaiting (so a test cancels it mid-await).
ASYNC_STARTED = threading.Event()


async def _record(name: str, ctx, payload=None) -> None:
    """A provider log row from a coroutine: Django's ORM through its async API."""
    await ProviderCall.objects.acreate(
        action=name, effect_key=ctx.effect_key, payload=payload, pid=os.getpid()
    )


class AsyncAdd(Action):
    name = "callers.async_add"
    effect = Effect.PURE

    async def run(self, ctx, input):
        await asyncio.sleep(0)
        await _record(self.name, ctx)
        return succeeded({"sum": input["a"] + input["b"]})


class AsyncForever(Action):
    """Awaits until cancelled; notes the cancellation, then returns a (late) result."""

    name = "callers.async_forever"
    effect = Effect.PURE
    timeout = 600

    async def run(self, ctx, input):
        ASYNC_STARTED.set()
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            ASYNC_CANCELLED.set()
            return succeeded({"late": True})  # after the cancellation: discarded
        return succeeded({"late": False})


class AsyncSlowOnce(Action):
    """Overruns its 1 s timeout on the first call (cancelled), answers at once after."""

    name = "callers.async_slow_once"
    effect = Effect.PURE
    timeout = 1

    async def run(self, ctx, input):
        first = not await ProviderCall.objects.filter(action=self.name).aexists()
        await _record(self.name, ctx, "first" if first else "again")
        if first:
            await asyncio.sleep(600)
        return succeeded({"first": first})


class AsyncGuarded(Action):
    name = "callers.async_guarded"
    effect = Effect.IDEMPOTENT

    async def plan(self, ctx, input):
        return succeeded({"planned": True, "to": input["to"]}, summary=f"would send {input['to']}")

    async def authorize(self, ctx, input):
        await asyncio.sleep(0)
        if input["to"] == "mallory":
            return failed("not to mallory", code="FORBIDDEN")
        return None

    async def run(self, ctx, input):
        await _record(self.name, ctx, input["to"])
        return succeeded({"sent": input["to"]})


class AsyncCharge(Action):
    """An async external effect with an async lookup by effect key."""

    name = "callers.async_charge"
    effect = Effect.EXTERNAL

    async def plan(self, ctx, input):
        return succeeded({"planned": True})

    async def run(self, ctx, input):
        await _record(self.name, ctx, input["amount"])
        if os.environ.get("K2B_TEST_CRASH") == "async_external":
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(0)
        return succeeded({"charged": input["amount"]})

    async def reconcile(self, ctx, input):
        row = await ProviderCall.objects.filter(
            action=self.name, effect_key=ctx.effect_key
        ).afirst()
        if row is None:
            return failed("no such charge")
        return succeeded({"charged": row.payload, "reconciled": True})


one_step("callers.async_add", AsyncAdd)
one_step("callers.async_forever", AsyncForever)
one_step("callers.async_slow_once", AsyncSlowOnce)
one_step("callers.async_guarded", AsyncGuarded)
one_step("callers.async_charge", AsyncCharge)
