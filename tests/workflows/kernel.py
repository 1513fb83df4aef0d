"""Actions and workflows for the kernel's own tests (effect classes, retries, crashes).

Freeze points: an action whose input names a ``freeze`` point stops its own
process with SIGSTOP there when ``K2B_TEST_FREEZE`` names the same point, so a
test freezes a worker at an exact place instead of racing a sleep; the test
sends SIGCONT later. In-process tests raise ``SimulatedCrash`` instead: a
``BaseException`` that unwinds the executing thread like a process death
would, leaving the run ``running`` with its lease.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import defaultdict

from django.db import connections, transaction

from k2b_workflows import (
    Action,
    Dependency,
    Effect,
    ambiguous,
    failed,
    succeeded,
    waiting,
    workflow,
)
from k2b_workflows.models import BudgetCharge, LedgerEntry
from tests.models import DomainRow, ProviderCall
from tests.support.workflow_steps import one_step
from tests.workflows import Charge, crash_point

#: In-process attempt counters, keyed by (action, effect_key): they survive a rollback.
ATTEMPTS: dict[tuple[str, str], int] = defaultdict(int)
#: Errors actions observed, for the tests to inspect.
OBSERVED: list[dict] = []


class SimulatedCrash(BaseException):
    """Unwinds an in-process execution the way a killed process stops it: no handler runs."""


def freeze_point(input, point: str) -> None:
    if (
        isinstance(input, dict)
        and input.get("freeze") == point
        and os.environ.get("K2B_TEST_FREEZE") == point
    ):
        # Directed at this thread: it stops on return from the call. A signal sent to the
        # process goes to the main thread, and this one could run on (and commit) meanwhile.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def _attempt(action: Action, ctx) -> int:
    """Count this call (1-based) outside any transaction the action is in."""
    ATTEMPTS[(action.name, ctx.effect_key)] += 1
    return ATTEMPTS[(action.name, ctx.effect_key)]


class Record(Action):
    """PURE: logs every call, so a test sees whether replay called it again."""

    name = "kernel.record"
    effect = Effect.PURE

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name, effect_key=ctx.effect_key, generation=ctx.generation, pid=os.getpid()
        )
        return succeeded({"n": input.get("n")})


class Slow(Action):
    """PURE: logs its start, then sleeps (a step a graceful stop must let finish)."""

    name = "kernel.slow"
    effect = Effect.PURE

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name, effect_key=ctx.effect_key, generation=ctx.generation, pid=os.getpid()
        )
        time.sleep(float(input.get("seconds", 1)))
        return succeeded({"slept": input.get("seconds", 1)})


class Overrun(Action):
    """PURE, with a one-second timeout: logs its start, then sleeps past it, deaf to the abort."""

    name = "kernel.overrun"
    effect = Effect.PURE
    timeout = 1.0

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name, effect_key=ctx.effect_key, generation=ctx.generation, pid=os.getpid()
        )
        time.sleep(float(input.get("seconds", 4)))
        return succeeded({"slept": input.get("seconds", 4)})


class TxProbe(Action):
    """TRANSACTIONAL: reports the block it runs in and fails after writing, ``fail_times`` times."""

    name = "kernel.tx_probe"
    effect = Effect.TRANSACTIONAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        attempt = _attempt(self, ctx)
        using = ctx.tx.using
        conn = connections[using]
        facts = {
            "using": using,
            "atomic": conn.in_atomic_block,
            "is_atomic_block": isinstance(ctx.tx, transaction.Atomic),
            "run_row_locked": _run_row_locked_elsewhere(ctx),
            "attempt": attempt,
        }
        OBSERVED.append(facts)
        DomainRow.objects.using(using).create(
            key=f"{input['key']}:{attempt}", value=facts, generation=ctx.generation
        )
        if attempt <= input.get("fail_times", 0):
            raise RuntimeError(f"failing after the write, attempt {attempt}")
        if input.get("bad") == "not_a_result":
            return {"not": "a result"}
        if input.get("bad") == "non_json":
            return succeeded({"when": object()})
        return succeeded({"attempt": attempt})


def _run_row_locked_elsewhere(ctx) -> bool:
    """Ask from another connection whether the run row is locked (NOWAIT fails if it is)."""
    import psycopg

    wrapper = connections[ctx.tx.using]
    other = wrapper.get_new_connection(wrapper.get_connection_params())
    try:
        other.autocommit = False
        try:
            other.execute("SELECT 1 FROM k2b_run WHERE id = %s FOR UPDATE NOWAIT", [ctx.run_id])
            return False
        except psycopg.errors.LockNotAvailable:
            return True
    finally:
        other.close()


class TxDeadlock(Action):
    """TRANSACTIONAL: on its first attempt, walks into a real deadlock and loses it (40P01)."""

    name = "kernel.tx_deadlock"
    effect = Effect.TRANSACTIONAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        attempt = _attempt(self, ctx)
        using = ctx.tx.using
        a, b = input["a"], input["b"]
        if attempt == 1:
            with connections[using].cursor() as cursor:
                # This session detects the cycle first and is the one rolled back.
                cursor.execute("SET LOCAL deadlock_timeout = '100ms'")
            list(DomainRow.objects.using(using).select_for_update().filter(key=a))
            other = _LockInOtherOrder(using, first=b, then=a)
            other.start()
            other.blocked.wait(10)
            try:
                list(DomainRow.objects.using(using).select_for_update().filter(key=b))
            except Exception as exc:
                from k2b_workflows.kernel import db

                OBSERVED.append({"deadlock_sqlstate": db.sqlstate(exc)})
                raise
            finally:
                other.join(15)
        DomainRow.objects.using(using).filter(key=a).update(value={"attempt": attempt})
        return succeeded({"attempt": attempt})


class _LockInOtherOrder(threading.Thread):
    """A second session that locks ``first``, then waits for ``then``: half of a deadlock."""

    def __init__(self, using: str, first: str, then: str) -> None:
        super().__init__(daemon=True)
        self.using, self.first, self.then = using, first, then
        self.blocked = threading.Event()

    def run(self) -> None:
        wrapper = connections[self.using]
        conn = wrapper.get_new_connection(wrapper.get_connection_params())
        try:
            conn.autocommit = False
            conn.execute("SET LOCAL deadlock_timeout = '10s'")
            pid = conn.info.backend_pid
            conn.execute("SELECT 1 FROM tests_domainrow WHERE key = %s FOR UPDATE", [self.first])
            watcher = threading.Thread(target=self._signal_when_waiting, args=(pid,), daemon=True)
            watcher.start()
            conn.execute("SELECT 1 FROM tests_domainrow WHERE key = %s FOR UPDATE", [self.then])
            conn.commit()
        finally:
            self.blocked.set()
            conn.close()

    def _signal_when_waiting(self, pid: int) -> None:
        wrapper = connections[self.using]
        conn = wrapper.get_new_connection(wrapper.get_connection_params())
        conn.autocommit = True
        try:
            for _ in range(1000):
                row = conn.execute(
                    "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid]
                ).fetchone()
                if row and row[0] == "Lock":
                    break
                time.sleep(0.01)
        finally:
            conn.close()
            self.blocked.set()


class IdemProbe(Action):
    """IDEMPOTENT: logs the effect key and whether its budget charge was committed first."""

    name = "kernel.idem_probe"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def cost(self, input):
        return {"emails": 1}

    def run(self, ctx, input):
        attempt = _attempt(self, ctx)
        charged = BudgetCharge.objects.filter(run_id=ctx.run_id, seq=ctx.step).count()
        ProviderCall.objects.create(
            action=self.name,
            effect_key=ctx.effect_key,
            generation=ctx.generation,
            pid=os.getpid(),
            payload={"charged_before_run": charged, "attempt": attempt},
        )
        if attempt <= input.get("fail_times", 0):
            raise ConnectionError("provider hiccup")
        return succeeded({"effect_key": ctx.effect_key})


class IdemStale(Action):
    """IDEMPOTENT: another worker takes the run over mid-action; the fenced write must refuse."""

    name = "kernel.idem_stale"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        from k2b_workflows import LeaseLost

        if _attempt(self, ctx) == 1:
            # What a claim by another worker does: raise the fence.
            with connections["default"].cursor() as cursor:
                cursor.execute(
                    "UPDATE k2b_run SET generation = generation + 1 WHERE id = %s", [ctx.run_id]
                )
        try:
            with ctx.fenced():
                DomainRow.objects.create(key=f"stale:{ctx.generation}", generation=ctx.generation)
        except LeaseLost as exc:
            OBSERVED.append({"refused_generation": ctx.generation, "error": str(exc)})
            raise
        return succeeded({"generation": ctx.generation})


class IdemFreeze(Action):
    """IDEMPOTENT: calls the provider with the effect key, then writes its result fenced.

    Freeze or crash points: ``idem_in_fence`` (holding the run lock inside ``ctx.fenced()``).
    """

    name = "kernel.idem_freeze"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name, effect_key=ctx.effect_key, generation=ctx.generation, pid=os.getpid()
        )
        with ctx.fenced():
            DomainRow.objects.create(
                key=f"idem:{ctx.effect_key}:{ctx.generation}",
                generation=ctx.generation,
                pid=os.getpid(),
            )
            freeze_point(input, "idem_in_fence")
        return succeeded({"generation": ctx.generation})


class TxFreeze(Action):
    """TRANSACTIONAL: writes a row in ``ctx.tx``, then may freeze holding the run lock."""

    name = "kernel.tx_freeze"
    effect = Effect.TRANSACTIONAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        DomainRow.objects.using(ctx.tx.using).create(
            key=f"{input['key']}:{ctx.generation}", generation=ctx.generation, pid=os.getpid()
        )
        freeze_point(input, "tx_after_write")
        return succeeded({"generation": ctx.generation})


class ChargeFreeze(Action):
    """EXTERNAL: the provider records the charge, then the worker may freeze before returning."""

    name = "kernel.charge_freeze"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        call = ProviderCall.objects.create(
            action=self.name,
            effect_key=ctx.effect_key,
            invocation_key=ctx.invocation_key or "",
            generation=ctx.generation,
            pid=os.getpid(),
        )
        freeze_point(input, "external_after_effect")
        return succeeded({"charge_id": f"ch_{call.pk}", "generation": ctx.generation})

    # The provider's lookup by effect key, as the tests' card charge has it.
    reconcile = Charge.reconcile


class ExternalProbe(Action):
    """EXTERNAL: reports the ledger as it stands when ``run()`` starts; behaves as asked."""

    name = "kernel.external_probe"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        dispatched = list(
            LedgerEntry.objects.filter(
                run_id=ctx.run_id, seq=ctx.step, kind=LedgerEntry.Kind.DISPATCHED
            ).values(
                "invocation_key",
                "effect_key",
                "definition_hash",
                "input_hash",
                "preview_hash",
                "principal_hash",
                "idempotency_key_hash",
                "generation",
            )
        )
        lost = input.get("lost_first") and ctx.invocation_key.endswith(":1")
        ProviderCall.objects.create(
            action="kernel.external_probe.attempt",
            effect_key=ctx.effect_key,
            invocation_key=ctx.invocation_key or "",
            generation=ctx.generation,
            payload={"dispatched_before_run": dispatched},
        )
        if lost:
            raise ConnectionError("the request never reached the provider")
        if input.get("crash_first") and ctx.invocation_key.endswith(":1"):
            raise SimulatedCrash
        ProviderCall.objects.create(
            action=self.name, effect_key=ctx.effect_key, invocation_key=ctx.invocation_key or ""
        )
        behaviour = input.get("behaviour")
        if behaviour == "ambiguous":
            return ambiguous("provider answered 502")
        return succeeded({"ok": True})

    def reconcile(self, ctx, input):
        ProviderCall.objects.create(
            action="kernel.external_probe.reconcile",
            effect_key=ctx.effect_key,
            invocation_key=ctx.invocation_key or "",
        )
        found = ProviderCall.objects.filter(action=self.name, effect_key=ctx.effect_key).first()
        if found is None:
            return failed("the provider has no such request", retryable=True)
        return succeeded({"ok": True, "reconciled": True})


class TxDenied(Action):
    """TRANSACTIONAL whose authorize() refuses: nothing it would write may exist."""

    name = "kernel.tx_denied"
    effect = Effect.TRANSACTIONAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def authorize(self, ctx, input):
        return failed("not for you", code="FORBIDDEN")

    def run(self, ctx, input):
        DomainRow.objects.using(ctx.tx.using).create(key="denied")
        return succeeded({})


class WaitSignal(Action):
    """PURE: waits on ("signal", key) until a DomainRow with that key exists."""

    name = "kernel.wait_signal"
    effect = Effect.PURE

    def run(self, ctx, input):
        if DomainRow.objects.filter(key=input["key"]).exists():
            return succeeded({"seen": input["key"]})
        return waiting(Dependency("signal", input["key"]))


one_step("kernel.tx_probe", TxProbe)


one_step("kernel.tx_deadlock", TxDeadlock)


one_step("kernel.tx_denied", TxDenied)


one_step("kernel.idem_probe", IdemProbe, effect_budget={"emails": 3})


one_step("kernel.idem_stale", IdemStale)


one_step("kernel.external_probe", ExternalProbe)


@workflow("kernel.replay", app_id="tests")
def replay_workflow(run, input):
    from tests.workflows import Flaky

    first = run.step(Record, {"n": 1})
    run.step(Flaky, {"times": input.get("times", 1)})
    return first


@workflow("kernel.two_flaky", app_id="tests")
def two_flaky_workflow(run, input):
    from tests.workflows import Flaky

    a = run.step(Flaky, {"times": input["times"], "which": "a"})
    b = run.step(Flaky, {"times": input["times"], "which": "b"})
    return {"a": a["attempts"], "b": b["attempts"]}


@workflow("kernel.swallow", app_id="tests")
def swallowing_workflow(run, input):
    try:
        run.step(WaitSignal, {"key": input["key"]})
    except Exception:  # the point: this must not catch a park
        return {"swallowed": True}
    return {"swallowed": False}


@workflow("kernel.tamper", app_id="tests")
def tamper_workflow(run, input):
    first = run.step(Record, {"n": 1})
    run.step(WaitSignal, {"key": input["key"]})
    return first


class EditEarlierStep(Action):
    """PURE, played by an attacker: while this step runs, step 0's journaled output is
    edited in place (append-only trigger bypassed, hashes left as they were)."""

    name = "kernel.edit_earlier_step"
    effect = Effect.PURE

    def run(self, ctx, input):
        import pgtrigger

        from k2b_workflows.models import JournalEntry

        with pgtrigger.ignore("k2b_workflows.JournalEntry:journal_append_only"):
            JournalEntry.objects.filter(run_id=ctx.run_id, seq=0).update(output={"n": 999})
        return succeeded({"edited": True})


@workflow("kernel.tamper_while_running", app_id="tests")
def tamper_while_running_workflow(run, input):
    first = run.step(Record, {"n": 1})
    # A PURE success rides on the run's next write: this step's block commits step 0's
    # entry, so that there is a stored entry for the attacker to edit.
    run.step(TxFreeze, {"key": "tamper"})
    run.step(EditEarlierStep, {})
    return first


class EditEarlierDispatch(Action):
    """PURE, played by an attacker: while this step runs, the "dispatched" ledger entry
    of step 0 gets a message it was not chained with (trigger bypassed, hashes kept)."""

    name = "kernel.edit_earlier_dispatch"
    effect = Effect.PURE

    def run(self, ctx, input):
        import pgtrigger

        with pgtrigger.ignore("k2b_workflows.LedgerEntry:ledger_append_only"):
            LedgerEntry.objects.filter(
                run_id=ctx.run_id, seq=0, kind=LedgerEntry.Kind.DISPATCHED
            ).update(message="edited")
        return succeeded({"edited": True})


@workflow("kernel.ledger_tamper_while_running", app_id="tests")
def ledger_tamper_while_running_workflow(run, input):
    first = run.step(ExternalProbe, {})
    run.step(EditEarlierDispatch, {})
    return first


class RewriteChainWhileRunning(Action):
    """PURE, played by an attacker: while this step runs, the run's chains are changed in
    a way that keeps every stored hash as it was: an anchor on the run row set back to
    the empty chain's, or the ledger's last entry deleted (trigger bypassed)."""

    name = "kernel.rewrite_chain_while_running"
    effect = Effect.PURE

    def run(self, ctx, input):
        import pgtrigger

        from k2b_workflows.kernel import evidence
        from k2b_workflows.models import WorkflowRun

        attack = input["attack"]
        if attack in ("journal_anchor", "ledger_anchor"):
            initial = evidence.initial_anchors(ctx.run_id)[attack]
            WorkflowRun.objects.filter(pk=ctx.run_id).update(**{attack: initial})
        else:
            last = LedgerEntry.objects.filter(run_id=ctx.run_id).latest("id")
            with pgtrigger.ignore("k2b_workflows.LedgerEntry:ledger_append_only"):
                LedgerEntry.objects.filter(pk=last.pk).delete()
        return succeeded({"attacked": attack})


@workflow("kernel.chain_rewritten_while_running", app_id="tests")
def chain_rewritten_while_running_workflow(run, input):
    first = run.step(ExternalProbe, {})
    run.step(Record, {"n": 1})
    run.step(RewriteChainWhileRunning, input)
    return first


@workflow("kernel.slow", app_id="tests")
def slow_workflow(run, input):
    run.step(Slow, {"seconds": input.get("seconds", 1)})
    run.step(Record, {"n": 2})
    return {"done": True}


one_step("kernel.overrun", Overrun)


one_step("kernel.tx_freeze", TxFreeze)


one_step("kernel.idem_freeze", IdemFreeze)


one_step("kernel.charge_freeze", ChargeFreeze)


@workflow("kernel.other_app", app_id="kernel_other")
def other_app_workflow(run, input):
    return run.step(Record, {"n": 0})


class BlindOnce(Action):
    """EXTERNAL without reconcile: the first invocation's answer is lost (ambiguous)."""

    name = "kernel.blind_once"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name, effect_key=ctx.effect_key, invocation_key=ctx.invocation_key or ""
        )
        if ctx.invocation_key.endswith(":1"):
            return ambiguous("the provider's answer was lost")
        return succeeded({"sent": ctx.invocation_key})


@workflow("kernel.blind_once", app_id="tests")
def blind_once_workflow(run, input):
    sent = run.step(BlindOnce, {})
    run.step(Record, {"n": 1})
    return sent


class CountedPure(Action):
    """PURE: records each call (a test-only trace outside the journal), then may crash or
    freeze where its input says: after an earlier PURE step's ``run()`` returned, before
    the run's next write."""

    name = "kernel.counted_pure"
    effect = Effect.PURE

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name, effect_key=ctx.effect_key, generation=ctx.generation, pid=os.getpid()
        )
        crash_point(input, "pure_riding")
        freeze_point(input, "pure_riding")
        return succeeded({"i": input["i"]})


@workflow("kernel.pure_riding", app_id="tests")
def pure_riding(run, input):
    """PURE steps whose successes ride on the next write: a TRANSACTIONAL step's block
    (``write``) or the run's end. ``at``: the step that crashes or freezes."""
    at = input.get("at")

    def point(i):
        return {"i": i, "crash": "pure_riding", "freeze": "pure_riding"} if i == at else {"i": i}

    run.step(CountedPure, point(0))
    run.step(CountedPure, point(1))
    if input.get("write"):
        run.step(TxFreeze, {"key": "riding"})
    return run.step(CountedPure, point(2))
