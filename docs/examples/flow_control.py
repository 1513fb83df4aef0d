"""docs/flow-control.md: one sync per tenant, a provider's rate limit, priorities and delays."""

from datetime import timedelta

from django.utils import timezone

from k2b_workflows import (
    Action,
    Concurrency,
    Effect,
    RateLimit,
    pause_queue,
    resume_queue,
    start_workflow_run,
    succeeded,
    workflow,
)


class PullTenant(Action):
    name = "crm.pull_tenant"
    effect = Effect.PURE

    def run(self, ctx, input):
        return succeeded({"tenant": input["tenant"], "pulled": True})


# --8<-- [start:concurrency]
@workflow("crm.sync_tenant", app_id="crm", concurrency=Concurrency(limit=1))
def sync_tenant(run, input):
    return run.step(PullTenant, {"tenant": input["tenant"]})


def sync_later(tenant_id, *, paid):
    # One sync per tenant at a time, paid tenants first, in five minutes.
    return start_workflow_run(
        "crm.sync_tenant",
        {"tenant": tenant_id},
        concurrency_key=f"tenant-{tenant_id}",
        priority=5 if paid else 0,
        run_after=timezone.now() + timedelta(minutes=5),
    )
# --8<-- [end:concurrency]


# --8<-- [start:rate_limit]
class Complete(Action):
    name = "openai.complete"
    effect = Effect.IDEMPOTENT
    rate_limit = RateLimit(60, per=timedelta(minutes=1))  # every worker, every host

    def rate_limit_key(self, input):  # optional: one limit per API key
        return input["api_key_id"]

    def plan(self, ctx, input):
        return succeeded({"text": "(planned)", "planned": True})

    def run(self, ctx, input):
        return succeeded({"text": f"answer to {input['prompt']}"})
# --8<-- [end:rate_limit]


@workflow("ai.answer", app_id="crm")
def answer(run, input):
    return run.step(Complete, input)


# --8<-- [start:cancel_in_progress]
@workflow(
    "site.deploy",
    app_id="crm",
    concurrency=Concurrency(limit=1, strategy="cancel_in_progress"),
)
def deploy(run, input):
    return run.step(PullTenant, {"tenant": input["site"]})


def deploy_now(site, commit):
    # A newer deploy of the same site cancels the one in progress: the latest wins.
    return start_workflow_run("site.deploy", {"site": site, "commit": commit}, concurrency_key=site)
# --8<-- [end:cancel_in_progress]


# --8<-- [start:queues]
@workflow("crm.export_tenant", app_id="crm", queue="exports")
def export_tenant(run, input):
    return run.step(PullTenant, {"tenant": input["tenant"]})


def export_now(tenant_id, *, urgent=False):
    # In the queue "exports" (runworkflows --queue exports), or "urgent" for this run.
    return start_workflow_run(
        "crm.export_tenant", {"tenant": tenant_id}, queue="urgent" if urgent else None
    )


def hold_exports(operator):
    # Every worker stops claiming the queue's runs; enqueues still go in, and wait.
    pause_queue("exports", reason="the CRM's export API is down", actor=operator)


def release_exports(operator):
    # Every worker is woken: the queue's runs are claimed at once.
    resume_queue("exports", actor=operator)
# --8<-- [end:queues]
