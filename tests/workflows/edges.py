"""Actions for the kernel's less travelled paths: heartbeats, failing hooks, charges in a tx."""

from __future__ import annotations

from django.db import connection

from k2b_workflows import (
    Action,
    Effect,
    InvalidInput,
    LeaseLost,
    RunCanceled,
    succeeded,
    workflow,
)
from k2b_workflows.control import cancel_run
from tests.models import DomainRow, ProviderCall
from tests.support.workflow_steps import one_step


def _lease(run_id) -> float:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT extract(epoch FROM lease_expires_at) FROM k2b_run WHERE id = %s", [run_id]
        )
        return float(cursor.fetchone()[0])


def _note(ctx, what: str) -> None:
    ProviderCall.objects.create(
        action="edges.heartbeat",
        effect_key=ctx.effect_key,
        generation=ctx.generation,
        payload={"what": what},
    )


class HeartbeatProbe(Action):
    """IDEMPOTENT: exercises ``ctx.heartbeat()`` without a transaction."""

    name = "edges.heartbeat"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        mode = input["mode"]
        if mode == "renew":
            before = _lease(ctx.run_id)
            ctx.heartbeat()
            return succeeded({"renewed": _lease(ctx.run_id) > before})
        if (
            mode == "takeover"
            and not ProviderCall.objects.filter(
                action=self.name, payload__what="LeaseLost"
            ).exists()
        ):
            # Another worker's claim: the fence moves on while this one still runs.
            with connection.cursor() as cursor:
                cursor.execute(
                    "UPDATE k2b_run SET generation = generation + 1 WHERE id = %s", [ctx.run_id]
                )
            try:
                ctx.heartbeat()
            except LeaseLost:
                _note(ctx, "LeaseLost")
                assert ctx.canceled.is_set()
                raise
        if mode == "cancel":
            # Ended at once under the action, as a timeout ends it: a cancel_workflow_run
            # only asks a running run, and its heartbeat goes on (#49).
            cancel_run(ctx.run_id, "canceled while the action ran")
            try:
                ctx.heartbeat()
            except RunCanceled:
                _note(ctx, "RunCanceled")
                raise
        if mode == "bad_alias":
            try:
                ctx.heartbeat(tx="elsewhere")
            except InvalidInput as exc:
                return succeeded({"refused": str(exc)})
        return succeeded({"mode": mode})


class HeartbeatInTransaction(Action):
    """TRANSACTIONAL: holds the run lock, so a heartbeat must name the transaction."""

    name = "edges.heartbeat_in_tx"
    effect = Effect.TRANSACTIONAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        try:
            ctx.heartbeat()
        except RuntimeError as exc:
            ctx.heartbeat(tx=ctx.tx.using)  # the right way: renews under the lock we hold
            return succeeded({"refused": str(exc)})
        return succeeded({"refused": None})


class CostlyWrite(Action):
    """TRANSACTIONAL with a cost: the charge commits with the write, or neither does."""

    name = "edges.costly_write"
    effect = Effect.TRANSACTIONAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def cost(self, input):
        return {"writes": 1}

    def run(self, ctx, input):
        DomainRow.objects.using(ctx.tx.using).create(key=input["key"])
        return succeeded({"key": input["key"]})


class BrokenAuthorize(Action):
    """authorize() fails with an unexpected error twice, then allows."""

    name = "edges.broken_authorize"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def authorize(self, ctx, input):
        seen = ProviderCall.objects.filter(
            action="edges.authorize", effect_key=ctx.effect_key
        ).count()
        ProviderCall.objects.create(action="edges.authorize", effect_key=ctx.effect_key)
        if seen < 2:
            raise ConnectionError("permission service unavailable")
        if input.get("garbage"):
            return "yes"
        return None

    def run(self, ctx, input):
        ProviderCall.objects.create(action=self.name, effect_key=ctx.effect_key)
        return succeeded({"sent": True})


one_step("edges.heartbeat", HeartbeatProbe)


one_step("edges.heartbeat_in_tx", HeartbeatInTransaction)


@workflow("edges.costly_writes", app_id="tests", effect_budget={"writes": 1})
def costly_writes_workflow(run, input):
    run.step(CostlyWrite, {"key": "first"})
    return run.step(CostlyWrite, {"key": "second"})


one_step("edges.broken_authorize", BrokenAuthorize)
