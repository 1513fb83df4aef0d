"""docs/schedules.md: a nightly report on a cron in Berlin, an hourly digest per tenant."""

import datetime as dt

from k2b_workflows import Action, Effect, Schedule, schedule_workflow, succeeded, workflow


class BuildReport(Action):
    name = "reports.build"
    effect = Effect.PURE

    def run(self, ctx, input):
        return succeeded({"kind": input["kind"], "day": input["day"]})


class SendDigest(Action):
    name = "mail.send_digest"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True}, summary=f"Digest for tenant {input['tenant']}")

    def run(self, ctx, input):
        # The provider deduplicates by ctx.effect_key: a run retried after a crash
        # sends nothing twice.
        return succeeded({"sent": True, "tenant": input["tenant"]})


# --8<-- [start:decorator]
@workflow(
    "reports.nightly",
    app_id="reports",
    schedule=Schedule(cron="0 3 * * *", timezone="Europe/Berlin", input={"kind": "daily"}),
)
def nightly(run, input):
    # input == {"kind": "daily", "scheduled_for": "2027-01-05T02:00:00+00:00"}
    return run.step(BuildReport, {"kind": input["kind"], "day": input["scheduled_for"][:10]})
# --8<-- [end:decorator]


@workflow("mail.digest", app_id="mail")
def digest(run, input):
    return run.step(SendDigest, {"tenant": input["tenant"], "hour": input["scheduled_for"]})


# --8<-- [start:in_code]
def schedule_tenant_digest(tenant_id: int):
    return schedule_workflow(
        f"tenant-{tenant_id}-digest",
        "mail.digest",
        Schedule(
            every=dt.timedelta(hours=1),
            input={"tenant": tenant_id},
            catch_up="all",  # after downtime, every missed hour gets its digest
            overlap="allow",  # even while an earlier hour's run is still going
        ),
    )
# --8<-- [end:in_code]
