"""Actions and workflows the test suite runs (discovered like any app's ``workflows`` module).

Crash points: an action whose input names a ``crash`` point kills its own
process with SIGKILL there when the environment variable ``K2B_TEST_CRASH``
names the same point. Tests start a first worker with the variable set and a
second one without it.
"""

from __future__ import annotations

import os
import signal
import time

from django.core.exceptions import PermissionDenied
from django.db import transaction

from k2b_workflows import (
    Action,
    Dependency,
    Effect,
    ambiguous,
    failed,
    succeeded,
    unknown,
    waiting,
    workflow,
)
from tests.models import DomainRow, ProviderCall
from tests.support.workflow_steps import one_step


def crash_point(input, point: str) -> None:
    if (
        isinstance(input, dict)
        and input.get("crash") == point
        and os.environ.get("K2B_TEST_CRASH") == point
    ):
        os.kill(os.getpid(), signal.SIGKILL)


def pause_point(input, point: str) -> None:
    """Sleep where the test asked, so it can SIGSTOP this process at a known place."""
    if isinstance(input, dict) and input.get("pause") == point:
        seconds = float(input.get("pause_s", 3))
        if os.environ.get("K2B_TEST_PAUSE", "1") == "1":
            time.sleep(seconds)


class Add(Action):
    name = "test.add"
    effect = Effect.PURE

    def run(self, ctx, input):
        crash_point(input, "pure")
        return succeeded({"sum": input["a"] + input["b"]}, summary="add")


class WriteRow(Action):
    """TRANSACTIONAL: the domain row commits with the journal entry, or neither does."""

    name = "test.write_row"
    effect = Effect.TRANSACTIONAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        DomainRow.objects.using(ctx.tx.using).create(
            key=input["key"], value=input.get("value"), generation=ctx.generation, pid=os.getpid()
        )
        crash_point(input, "tx_after_write")
        pause_point(input, "tx_after_write")
        if input.get("fail"):
            raise RuntimeError("boom after write")
        return succeeded({"key": input["key"]})


class SendIdempotent(Action):
    """IDEMPOTENT: the provider is called with ctx.effect_key; the result is stored fenced."""

    name = "test.send_idempotent"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def cost(self, input):
        return {"emails": 1} if input.get("costly") else {}

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name,
            effect_key=ctx.effect_key,
            generation=ctx.generation,
            pid=os.getpid(),
            payload={"to": input.get("to")},
        )
        crash_point(input, "idem_after_effect")
        pause_point(input, "idem_after_effect")
        with ctx.fenced():
            DomainRow.objects.create(
                key=f"idem:{ctx.effect_key}:{ctx.generation}",
                value=input.get("to"),
                generation=ctx.generation,
                pid=os.getpid(),
            )
        return succeeded({"message_id": ctx.effect_key})


class Charge(Action):
    """EXTERNAL with reconcile: the provider knows charges by effect key."""

    name = "test.charge"
    effect = Effect.EXTERNAL

    def cost(self, input):
        return {"charges": 1}

    def plan(self, ctx, input):
        return succeeded(
            {"planned": True, "amount": input.get("amount")},
            summary=f"Charge {input.get('amount')}",
        )

    def run(self, ctx, input):
        crash_point(input, "external_before_effect")
        call = ProviderCall.objects.create(
            action=self.name,
            effect_key=ctx.effect_key,
            invocation_key=ctx.invocation_key,
            generation=ctx.generation,
            pid=os.getpid(),
            payload={"amount": input.get("amount")},
        )
        crash_point(input, "external_after_effect")
        pause_point(input, "external_after_effect")
        behaviour = input.get("behaviour")
        if behaviour == "raise":
            raise ConnectionError("provider timed out")
        if behaviour == "ambiguous":
            return ambiguous("provider answered 502")
        if behaviour == "invalid":
            return {"not": "a result"}
        if behaviour == "non_json":
            return succeeded({"when": object()})
        if behaviour == "decline":
            return failed("card declined", code="CARD_DECLINED")
        return succeeded({"charge_id": f"ch_{call.pk}"})

    def reconcile(self, ctx, input):
        mode = input.get("reconcile", "lookup")
        if mode == "unknown":
            return unknown("provider has no lookup for this charge")
        if mode == "raise":
            raise ConnectionError("lookup failed")
        found = ProviderCall.objects.filter(action=self.name, effect_key=ctx.effect_key).first()
        if found is None:
            return failed("no charge with this key", retryable=True)
        return succeeded({"charge_id": f"ch_{found.pk}", "reconciled": True})


class ChargeByKey(Charge):
    """The provider deduplicates by the effect key: "absent" dispatches again under it."""

    name = "test.charge_by_key"
    redispatch_when_absent = True


class ChargeBlind(Charge):
    """EXTERNAL without reconcile: after any doubt an operator decides."""

    name = "test.charge_blind"
    reconcile = Action.reconcile


class DeleteAccount(Action):
    name = "test.delete_account"
    effect = Effect.IRREVERSIBLE

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        ProviderCall.objects.create(action=self.name, effect_key=ctx.effect_key)
        return succeeded({"deleted": True})


class RestoreSnapshot(Action):
    name = "test.restore_snapshot"
    effect = Effect.SNAPSHOT_RESTORE

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        ProviderCall.objects.create(action=self.name, effect_key=ctx.effect_key)
        return succeeded({"restored": True})


class Guarded(Action):
    name = "test.guarded"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def authorize(self, ctx, input):
        if input.get("deny") == "raise":
            raise PermissionDenied("not allowed for this principal")
        if input.get("deny") == "result":
            return failed("role missing", code="FORBIDDEN")
        return None

    def run(self, ctx, input):
        ProviderCall.objects.create(action=self.name, effect_key=ctx.effect_key)
        return succeeded({"ok": True})


class Flaky(Action):
    """PURE: fails retryably the first ``times`` attempts (counted in the provider table)."""

    name = "test.flaky"
    effect = Effect.PURE

    def run(self, ctx, input):
        with transaction.atomic():
            attempts = ProviderCall.objects.filter(action=self.name, effect_key=ctx.effect_key)
            n = attempts.count()
            ProviderCall.objects.create(action=self.name, effect_key=ctx.effect_key)
        if n < input.get("times", 1):
            if input.get("how") == "raise":
                raise RuntimeError(f"flaky attempt {n}")
            return failed(f"attempt {n}", retryable=True)
        return succeeded({"attempts": n + 1})


class BadResult(Action):
    name = "test.bad_result"
    effect = Effect.PURE

    def run(self, ctx, input):
        if input.get("kind") == "non_json":
            return succeeded({"x": {1, 2}})
        return "not a result"


class WaitFor(Action):
    """Waits on (kind, key) until a DomainRow with that key exists."""

    name = "test.wait_for"
    effect = Effect.PURE

    def run(self, ctx, input):
        row = DomainRow.objects.filter(key=input["key"]).first()
        ProviderCall.objects.create(
            action=self.name, effect_key=ctx.effect_key, generation=ctx.generation
        )
        if row is None:
            deadline = input.get("deadline_s")
            import datetime as dt

            return waiting(
                Dependency(
                    "signal",
                    input["key"],
                    deadline=dt.timedelta(seconds=deadline) if deadline else None,
                )
            )
        return succeeded({"value": row.value})


@workflow("test.pure", app_id="tests")
def pure_workflow(run, input):
    a = run.step(Add, {"a": input["a"], "b": input["b"]})
    b = run.step(
        Add, {"a": a["sum"], "b": 1, **({"crash": input["crash"]} if "crash" in input else {})}
    )
    return {"total": b["sum"]}


@workflow("test.tx", app_id="tests")
def tx_workflow(run, input):
    run.step(WriteRow, input)
    run.step(Add, {"a": 1, "b": 2, **({"crash": "pure"} if input.get("crash_next") else {})})
    return {"done": True}


one_step("test.idem", SendIdempotent, effect_budget={"emails": 5})


one_step("test.charge", Charge, effect_budget={"charges": 2})


one_step("test.charge_by_key", ChargeByKey, effect_budget={"charges": 2})


@workflow("test.charge_blind", app_id="tests")
def charge_blind_workflow(run, input):
    out = run.step(ChargeBlind, input)
    run.step(Add, {"a": 1, "b": 1})
    return out


@workflow("test.irreversible", app_id="tests")
def irreversible_workflow(run, input):
    return run.step(DeleteAccount, {}, approval_ref=input.get("approval_ref"))


@workflow("test.restore", app_id="tests")
def restore_workflow(run, input):
    return run.step(RestoreSnapshot, {}, backup_ref=input.get("backup_ref"))


one_step("test.guarded", Guarded)


one_step("test.flaky", Flaky)


one_step("test.bad_result", BadResult)


@workflow("test.catches", app_id="tests")
def catching_workflow(run, input):
    from k2b_workflows import StepFailed

    try:
        run.step(Charge, {"behaviour": "decline"})
    except StepFailed as exc:
        return {"caught": exc.code}
    return {"caught": None}


@workflow("test.wait", app_id="tests")
def wait_workflow(run, input):
    got = run.step(WaitFor, input)
    return {"got": got["value"]}


@workflow("test.nondeterministic", app_id="tests")
def nondeterministic_workflow(run, input):
    # Which action comes first depends on a row outside the journal: a bug.
    first = Add if not DomainRow.objects.filter(key="switch").exists() else Flaky
    run.step(first, {"a": 1, "b": 1})
    run.step(WaitFor, {"key": "never"})
    return {}


@workflow("test.non_json_output", app_id="tests")
def non_json_output_workflow(run, input):
    return {"when": object()}


# The topic modules register their actions and workflows on import.
from . import (  # noqa: E402
    callers,  # noqa: F401
    edges,  # noqa: F401
    fanout,  # noqa: F401
    fence,  # noqa: F401
    flow,  # noqa: F401
    forks,  # noqa: F401
    holders,  # noqa: F401
    integrity,  # noqa: F401
    kernel,  # noqa: F401
    misuse,  # noqa: F401
    polling,  # noqa: F401
    queues,  # noqa: F401
    schedules,  # noqa: F401
    secrets,  # noqa: F401
    survive,  # noqa: F401
    topology,  # noqa: F401
    tracing,  # noqa: F401
    versions,  # noqa: F401
    waits,  # noqa: F401
)
