"""A live holder's call is never raced (#47).

A lease is a promise to renew, not a sign of life. A worker stopped (SIGSTOP,
a starved host) past its lease inside an EXTERNAL call, or whose lease the
runtime role rewrote, is still there, and its call may still land: taken over,
the run asked ``reconcile()`` while the provider had not seen the call yet,
heard "absent", and ended FAILED for a charge that happened. Here the run
stays its holder's (its presence lock, ``kernel/holders.py``, is held) and
ends with the call's real answer, the provider called once and never asked.

A canceled holder keeps its concurrency slot until it has left ``run()``,
whatever its lease is rewritten to. And a late result that contradicts what a
takeover was told (a holder taken for gone: here one with no presence at all)
is an incident naming both ledger entries, never a silent FAILED.
"""

from __future__ import annotations

import io
import json
import signal
import threading
import uuid

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, connections, transaction

from k2b_workflows import EFFECT_CONFIRMED, resolve_effect, start_workflow_run
from k2b_workflows.codes import EFFECT_CONTRADICTED
from k2b_workflows.control import cancel_run
from k2b_workflows.kernel import claim, db, evidence
from k2b_workflows.kernel.execute import Execution
from k2b_workflows.kernel.leases import LeaseKeeper
from k2b_workflows.models import LedgerEntry, WorkflowRun
from tests.models import ProviderCall
from tests.support import runtime_role
from tests.support.kernel import (
    SETTLED,
    claim_for,
    describe,
    execute_exactly,
    expire_lease,
    fresh,
    ledger_kinds,
    most_inside,
    requeue_expired,
    span_edges,
)
from tests.support.runtime_role import RUNTIME, as_runtime, refused
from tests.tasks_app import tasks
from tests.workflows import fence as workflows_fence

pytestmark = [
    pytest.mark.crash,
    pytest.mark.django_db(transaction=True, databases=["default", RUNTIME]),
]

runtime = runtime_role.runtime

TIMEOUT = 120  # a shared machine: waits on conditions, never on the clock
LEASE_MS = 1500
SETTINGS = {"RUN_LEASE_MS": LEASE_MS, "RETRY_BACKOFF_MS": 50}


def env() -> dict[str, str]:
    return {"K2B_TEST_SETTINGS": json.dumps(SETTINGS)}


def provider(action: str) -> list[ProviderCall]:
    return list(ProviderCall.objects.filter(action=action).order_by("id"))


def ended(run: WorkflowRun) -> bool:
    return fresh(run).status in SETTLED


def charged_once_never_asked(run: WorkflowRun) -> None:
    """The run ended with its holder's own answer: one charge, that charge's id, no lookup."""
    done = fresh(run)
    assert done.status == "succeeded", describe(done)
    (charge,) = provider("holders.slow_charge")
    assert done.output == {"charge_id": f"ch_{charge.pk}"}
    assert provider("holders.reconcile") == []
    assert ledger_kinds(run) == ["dispatched", "succeeded"]
    # Never taken over: the one claim's generation did it all, and no incident.
    assert (done.generation, done.error_code) == (1, "")


def lease_rewritten_and_reaped(run_id: object) -> int:
    """As the runtime role: the run's lease set an hour back, then a reap, in one
    transaction (no renewal of the holder's comes in between). The runs re-queued."""
    with transaction.atomic(using=RUNTIME):
        with connections[RUNTIME].cursor() as cursor:
            cursor.execute(
                "UPDATE k2b_run SET lease_expires_at = now() - interval '1 hour' WHERE id = %s",
                [run_id],
            )
        return claim.reap_expired(RUNTIME)


def _heartbeat_stale(worker_pid: int) -> bool:
    """The stopped worker's heartbeat is older than a fresh one may be."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT heartbeat_at < k2b_now() - %s * interval '1 millisecond'"
            " FROM k2b_worker WHERE pid = %s",
            [2 * LEASE_MS, worker_pid],
        )
        row = cursor.fetchone()
    return bool(row and row[0])


def _lease_extended_since(run: WorkflowRun, since: object) -> bool:
    """Someone but the (stopped) holder extended the lease after ``since``."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT lease_expires_at > %s::timestamptz + %s * interval '1 millisecond'"
            " FROM k2b_run WHERE id = %s AND status = 'running'",
            [since, LEASE_MS // 2, run.pk],
        )
        row = cursor.fetchone()
    return bool(row and row[0])


def test_a_holder_stopped_inside_an_external_call_past_its_lease_keeps_the_run(start_worker, wait):
    run = start_workflow_run("holders.charge", {"seconds": 2})
    holder = start_worker("--concurrency", "1", env=env())
    wait(lambda: provider("holders.started"), timeout=TIMEOUT, message=holder.report)
    holder.signal(signal.SIGSTOP)
    try:
        other = start_worker("--concurrency", "1", env=env())
        # Its heartbeat stale, the holder is present by its lock alone; the other
        # worker's reaper finds the lease run out and extends it instead of taking it.
        wait(lambda: _heartbeat_stale(holder.pid), timeout=TIMEOUT, message=other.report)
        with connection.cursor() as cursor:
            cursor.execute("SELECT k2b_now()")
            (since,) = cursor.fetchone()
        wait(lambda: _lease_extended_since(run, since), timeout=TIMEOUT, message=other.report)
        assert provider("holders.reconcile") == []
    finally:
        holder.signal(signal.SIGCONT)
    wait(lambda: ended(run), timeout=TIMEOUT, message=holder.report)
    charged_once_never_asked(run)


def test_a_rewritten_lease_takes_no_run_from_a_live_holder_inside_an_external_call(
    start_worker, wait, runtime
):
    run = start_workflow_run("holders.charge", {"seconds": 4})
    workers = [start_worker("--concurrency", "1", env=env()) for _ in range(2)]
    wait(lambda: provider("holders.started"), timeout=TIMEOUT, message=workers[0].report)
    assert lease_rewritten_and_reaped(run.pk) == 0
    assert fresh(run).status == "running"
    wait(lambda: ended(run), timeout=TIMEOUT, message=workers[0].report)
    charged_once_never_asked(run)


def test_a_run_set_back_to_queued_is_not_reconciled_while_its_holder_is_inside_the_call(
    start_worker, wait, runtime
):
    """Taken without the reaper (the runtime role sets the status back), the next worker
    finds the call's worker present and waits for its answer; then it reconciles."""
    run = start_workflow_run("holders.charge", {"until_released": True})
    # No claim ahead: the holder's own process would take the run back for its busy
    # thread, and run it only once the call has returned.
    settings = {**SETTINGS, "CLAIM_PREFETCH": 0}
    env_ = {"K2B_TEST_SETTINGS": json.dumps(settings)}
    workers = [start_worker("--concurrency", "1", env=env_) for _ in range(2)]
    wait(lambda: provider("holders.started"), timeout=TIMEOUT, message=workers[0].report)
    as_runtime("UPDATE k2b_run SET status = 'queued', run_after = now() WHERE id = %s", [run.pk])
    # The other worker claims it, finds the call's worker present, and queues it again.
    wait(
        lambda: (r := fresh(run)).generation >= 2 and r.status != "running",
        timeout=TIMEOUT,
        message=lambda: workers[0].report() + workers[1].report(),
    )
    assert fresh(run).status == "queued", describe(run)
    assert provider("holders.reconcile") == []
    (started,) = provider("holders.started")
    ProviderCall.objects.create(action="holders.release", effect_key=started.effect_key)
    wait(
        lambda: ended(run),
        timeout=TIMEOUT,
        message=lambda: workers[0].report() + workers[1].report(),
    )
    done = fresh(run)
    assert done.status == "succeeded", describe(done)
    (charge,) = provider("holders.slow_charge")
    assert done.output == {"charge_id": f"ch_{charge.pk}", "reconciled": True}
    # Asked once, after the holder's own answer: never "absent".
    assert [c.payload for c in provider("holders.reconcile")] == [{"found": True}]
    kinds = ledger_kinds(run)
    assert kinds.index("late_result") < kinds.index("reconciled"), kinds
    (late,) = LedgerEntry.objects.filter(run=run, kind="late_result")
    assert late.detail["outcome"] == "succeeded" and "contradicts" not in late.detail


def test_a_rewritten_lease_takes_no_external_task_from_its_live_holder(start_worker, wait, runtime):
    """The django.tasks side: no reconcile, so a takeover went to an operator (and the
    caller saw RUNNING, then needs_attention) although the call succeeded."""
    result = tasks.slow_charge.enqueue("o-47", 3)
    workers = [start_worker("--concurrency", "1", env=env()) for _ in range(2)]
    wait(lambda: provider("task.slow_charge.started"), timeout=TIMEOUT, message=workers[0].report)
    assert lease_rewritten_and_reaped(result.id) == 0
    run = WorkflowRun.objects.get(pk=result.id)
    wait(lambda: ended(run), timeout=TIMEOUT, message=workers[0].report)
    done = tasks.slow_charge.get_result(result.id)
    assert (done.status.name, done.return_value) == ("SUCCESSFUL", {"charged": "o-47"})
    assert len(provider("task.slow_charge")) == 1
    assert (fresh(run).generation, fresh(run).error_code) == (1, "")


def test_a_rewritten_lease_takes_no_keyed_run_from_its_live_holder(start_worker, wait, runtime):
    key = f"keyed-{uuid.uuid4().hex[:8]}"
    run = start_workflow_run("flow.one_at_a_time", {"key": key, "nap": 4}, concurrency_key=key)
    worker = start_worker("--concurrency", "4", env=env())
    wait(lambda: span_edges(key), timeout=TIMEOUT, message=worker.report)
    assert lease_rewritten_and_reaped(run.pk) == 0
    wait(lambda: ended(run), timeout=TIMEOUT, message=worker.report)
    assert fresh(run).status == "succeeded", describe(run)
    assert span_edges(key) == ["start", "end"]


def test_a_dispatch_whose_answer_was_lost_is_reconciled_though_its_worker_lives(start_worker, wait):
    """What a failover to an asynchronous standby leaves: the new primary's ledger ends
    with a dispatch whose answer its worker wrote to the old primary only, and that
    worker lives on, long out of the call. Waited for while present, the run was
    left to it by every reap and deferred by every claim, for ever (the worker's own
    too). Out of the call (its call lock free), it is reconciled at once."""
    alive = LeaseKeeper("default", worker_id="w-after-failover")
    assert alive.connect() and alive.present.is_set()
    try:
        run = start_workflow_run("holders.charge_by_key", {})
        generation = claim_for(run, worker_id="w-after-failover")
        with transaction.atomic():
            db.lock_run("default", run.pk)
            evidence.append_ledger(
                "default",
                run_id=run.pk,
                seq=0,
                kind="dispatched",
                generation=generation,
                invocation_key=f"{run.pk}:0:1",
                detail={"worker": "w-after-failover"},
            )
        expire_lease(run)
        worker = start_worker("--concurrency", "1", env=env())
        wait(lambda: ended(run), timeout=TIMEOUT, message=worker.report)
    finally:
        alive.stop()
    done = fresh(run)
    assert done.status == "succeeded", describe(done)
    # Asked once, heard "absent" (the lost call never reached the provider), and
    # dispatched again under its key: one charge. Claimed here, then by the worker.
    assert [c.payload for c in provider("holders.reconcile")] == [{"found": False}]
    assert len(provider("holders.slow_charge")) == 1
    assert done.generation <= 3, describe(done)


# -- slots ------------------------------------------------------------------------------


@pytest.mark.parametrize("lease", ["now() - interval '1 hour'", "NULL"])
def test_a_canceled_holder_keeps_its_slot_whatever_its_lease_is_rewritten_to(
    start_worker, wait, runtime, lease
):
    key = f"rewrite-{uuid.uuid4().hex[:8]}"
    one = "flow.one_at_a_time"
    first = start_workflow_run(one, {"key": key, "nap": 4}, concurrency_key=key)
    worker = start_worker("--concurrency", "4", env=env())
    wait(lambda: span_edges(key), timeout=TIMEOUT, message=worker.report)
    # Ended at once under its action, as a timeout ends it (a cancel_workflow_run of a
    # running run only asks it, #49).
    cancel_run(first.pk, "not needed any more")
    assert fresh(first).status == "canceled"
    as_runtime(f"UPDATE k2b_run SET lease_expires_at = {lease} WHERE id = %s", [first.pk])
    # Nor may the holder's name go: the release asks about it.
    refused("UPDATE k2b_run SET claimed_by = '' WHERE id = %s", [first.pk])
    assert fresh(first).holds_slot
    second = start_workflow_run(one, {"key": key, "nap": 0}, concurrency_key=key)
    wait(lambda: ended(second), timeout=TIMEOUT, message=worker.report)
    assert fresh(second).status == "succeeded", describe(second)
    assert span_edges(key) == ["start", "end", "start", "end"]
    assert most_inside(key) == 1
    assert not fresh(first).holds_slot


# -- a late result against a decision ------------------------------------------------------


class GoneHolder:
    """A claim executed in a thread, stopped at the action's gate inside ``run()``.

    Its worker id names no worker and holds no presence lock: a holder any
    takeover must take for gone, as a frozen process on a site without
    presence locks would be.
    """

    def __init__(self, run: WorkflowRun, gate_name: str) -> None:
        self.gate = workflows_fence.GATES[gate_name] = workflows_fence.Gate()
        self.generation = claim_for(run, worker_id="gone")
        self.outcome: list[str] = []
        self.thread = threading.Thread(target=self._execute, args=(run.pk,), daemon=True)
        self.thread.start()
        assert self.gate.reached.wait(60), "the holder never reached its gate"

    def _execute(self, run_id: object) -> None:
        try:
            self.outcome.append(Execution(run_id, self.generation).execute())
        finally:
            connections.close_all()

    def returns(self) -> str:
        self.gate.go.set()
        self.thread.join(60)
        assert not self.thread.is_alive()
        return self.outcome[0]


def verify() -> str:
    out = io.StringIO()
    try:
        call_command("verifyworkflows", stdout=out)
    except CommandError as exc:
        pytest.fail(f"verifyworkflows failed: {exc}\n{out.getvalue()}")
    return out.getvalue()


@pytest.mark.parametrize(
    ("name", "after"),
    [
        # Reconciled "absent", no re-dispatch: the run failed. Ended, it stays so.
        ("holders.charge", "failed"),
        # Reconciled "absent", to be dispatched again under the key: in the queue.
        ("holders.charge_by_key", EFFECT_CONTRADICTED),
    ],
)
def test_a_late_result_that_contradicts_a_reconcile_is_an_incident_naming_both(
    name, after, operator
):
    gate_name = f"g{uuid.uuid4().hex}"
    run = start_workflow_run(name, {"gate": gate_name})
    holder = GoneHolder(run, gate_name)
    requeue_expired(run)
    execute_exactly(run.pk)
    (lookup,) = provider("holders.reconcile")
    assert lookup.payload == {"found": False}
    (reconciled,) = LedgerEntry.objects.filter(run=run, kind="reconciled")
    assert reconciled.detail["outcome"] == "failed"
    assert holder.returns() == "lease_lost"

    (charge,) = provider("holders.slow_charge")
    (late,) = LedgerEntry.objects.filter(run=run, kind="late_result")
    assert late.detail["outcome"] == "succeeded"
    assert late.detail["contradicts"] == {
        "entry": reconciled.pk,
        "kind": "reconciled",
        "outcome": "failed",
    }
    done = fresh(run)
    if after == "failed":
        assert done.status == "failed", describe(done)
    else:
        assert (done.status, done.error_code) == ("needs_attention", EFFECT_CONTRADICTED)
        assert done.error_detail["late_result"] == late.pk
        assert done.error_detail["entry"] == reconciled.pk
        assert done.attention_step == 0
    # Where operators look, whatever the status: both entries named, nothing broken.
    shown = verify()
    assert f"CONTRADICTED {run.pk}" in shown, shown
    assert f"late_result entry {late.pk} says succeeded" in shown
    assert f"reconciled entry {reconciled.pk} said failed" in shown
    assert "BROKEN" not in shown
    assert provider("holders.slow_charge") == [charge]  # no second dispatch
    if after == EFFECT_CONTRADICTED:
        # The operator settles it with the provider's answer, as any effect in doubt.
        resolve_effect(
            run.pk,
            EFFECT_CONFIRMED,
            evidence="the provider's dashboard shows the charge",
            actor=operator,
            output={"charge_id": f"ch_{charge.pk}"},
        )
        assert execute_exactly(run.pk) == "succeeded"
        assert fresh(run).output == {"charge_id": f"ch_{charge.pk}"}
        assert "CONTRADICTED" not in verify()


def test_a_reconcile_that_contradicts_the_calls_own_late_answer_is_an_incident():
    """The other order: the call answered its fenced-out worker first, then a lookup
    that lags behind the provider's writes says "absent"."""
    gate_name = f"g{uuid.uuid4().hex}"
    run = start_workflow_run("holders.charge", {"gate": gate_name, "lookup_lags": True})
    holder = GoneHolder(run, gate_name)
    requeue_expired(run)
    assert holder.returns() == "lease_lost"
    (late,) = LedgerEntry.objects.filter(run=run, kind="late_result")
    assert late.detail["outcome"] == "succeeded"
    assert execute_exactly(run.pk) == "needs_attention"
    done = fresh(run)
    assert (done.status, done.error_code) == ("needs_attention", EFFECT_CONTRADICTED)
    (answer,) = LedgerEntry.objects.filter(run=run, kind="reconcile_unknown")
    assert answer.detail == {
        "outcome": "failed",
        "contradicts": {"entry": late.pk, "kind": "late_result", "outcome": "succeeded"},
    }
    assert (done.error_detail["late_result"], done.error_detail["entry"]) == (late.pk, answer.pk)
    assert not LedgerEntry.objects.filter(run=run, kind="reconciled").exists()
    shown = verify()
    assert f"reconcile_unknown entry {answer.pk} says failed" in shown, shown
    assert f"late_result entry {late.pk} said succeeded" in shown
