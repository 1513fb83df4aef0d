"""The fence, write path by write path: a stale worker computes, but never commits.

Each test claims a run for a "stale" execution in a thread of its own (its own
connection), stops it at a gate just before one write path, and then either
takes the run over (lease expired, reaped, claimed again: a new generation,
``running``) or only reaps it (same generation, ``queued``). Then it lets the
stale execution go on and checks that nothing it wrote committed and that the
run's row is exactly what the new holder (or the queue) left.

Takeovers catch a fence without its generation condition; reaps catch one
without its status condition; the lock tests catch a fence that checks
without locking the row until commit. The ordering is by events and by the
row lock itself, never by sleeping.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from django.db import connection

from k2b_workflows import start_workflow_run
from k2b_workflows.kernel import claim
from k2b_workflows.kernel.execute import Execution
from k2b_workflows.models import BudgetCharge, JournalEntry, LedgerEntry, WorkflowRun
from tests.models import DomainRow, ProviderCall
from tests.support.processes import wait_for
from tests.workflows import fence as workflows_fence

pytestmark = pytest.mark.django_db(transaction=True)

MODES = ["takeover", "reap"]
THREAD_TIMEOUT_S = 60

_ROW_SQL = """SELECT status, generation, claimed_by, lease_expires_at, run_after, current_step,
                     consecutive_failures, wait_kind, wait_key, output, error_code, updated_at
                FROM k2b_run WHERE id = %s"""


def row_state(run_id: Any) -> tuple:
    with connection.cursor() as cursor:
        cursor.execute(_ROW_SQL, [run_id])
        return cursor.fetchone()


def claim_for_stale_worker(run: WorkflowRun) -> int:
    (claimed,) = claim.claim_runs(
        "default",
        worker_id="stale",
        workflows=[(run.workflow_name, run.workflow_version)],
        app_ids=None,
        limit=1,
    )
    assert claimed[0] == run.pk
    return claimed[1]


def lease_expired(run_id: Any) -> Any:
    def check() -> bool:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT lease_expires_at < statement_timestamp() FROM k2b_run WHERE id = %s",
                [run_id],
            )
            return bool(cursor.fetchone()[0])

    return check


def expire_and_reap(run_id: Any) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE k2b_run SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
            [run_id],
        )
    return claim.reap_expired("default")


def take_away(run: WorkflowRun, mode: str, stale_generation: int) -> tuple:
    """What happens while the stale worker is frozen: its lease runs out, then (takeover)
    another worker claims the run. Returns the run's row as the new holder left it."""
    assert expire_and_reap(run.pk) == 1
    if mode == "takeover":
        with connection.cursor() as cursor:
            cursor.execute("UPDATE k2b_run SET run_after = now() WHERE id = %s", [run.pk])
        claimed = claim.claim_runs(
            "default",
            worker_id="new-holder",
            workflows=[(run.workflow_name, run.workflow_version)],
            app_ids=None,
            limit=1,
        )
        assert claimed == [(run.pk, stale_generation + 1)]
        assert row_state(run.pk)[:3] == ("running", stale_generation + 1, "new-holder")
    else:
        assert row_state(run.pk)[:2] == ("queued", stale_generation)
    return row_state(run.pk)


class StaleWorker:
    """One claim executed in a thread with its own connection, stopped at the run's gate."""

    def __init__(self, run: WorkflowRun, gate_name: str) -> None:
        self.run = run
        self.gate = workflows_fence.GATES[gate_name] = workflows_fence.Gate()
        self.generation = claim_for_stale_worker(run)
        self.outcome: list[str] = []
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._execute, daemon=True)
        self.thread.start()
        assert self.gate.reached.wait(THREAD_TIMEOUT_S), "the stale worker never reached its gate"

    def _execute(self) -> None:
        from django.db import connections

        try:
            self.outcome.append(Execution(self.run.pk, self.generation).execute())
        except BaseException as exc:  # reported by finish()
            self.errors.append(exc)
        finally:
            connections.close_all()

    def finish(self) -> str:
        self.gate.go.set()
        self.thread.join(THREAD_TIMEOUT_S)
        assert not self.thread.is_alive(), "the stale worker did not end"
        assert not self.errors, self.errors
        return self.outcome[0]


def start(name: str, **extra: Any) -> tuple[WorkflowRun, str]:
    gate_name = f"g{uuid.uuid4().hex}"
    run = start_workflow_run(name, {"gate": gate_name, **extra})
    return run, gate_name


def stale_attempt(name: str, mode: str, **extra: Any) -> tuple[WorkflowRun, StaleWorker, tuple]:
    """Run ``name`` in a stale worker that loses the run (``mode``) at its gate, then goes on."""
    run, gate_name = start(name, **extra)
    stale = StaleWorker(run, gate_name)
    after = take_away(run, mode, stale.generation)
    outcome = stale.finish()
    assert outcome == "lease_lost", outcome
    return run, stale, after


def assert_nothing_committed(run: WorkflowRun, stale: StaleWorker, after: tuple) -> None:
    assert not DomainRow.objects.filter(generation=stale.generation).exists()
    assert not JournalEntry.objects.filter(run=run).exists()
    assert row_state(run.pk) == after, "the stale worker changed the run's row"


# -- the write paths ----------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_stale_transactional_step_commits_nothing_through_ctx_tx(mode):
    run, stale, after = stale_attempt("fence.tx", mode, path="ctx.tx")
    assert_nothing_committed(run, stale, after)


@pytest.mark.parametrize("mode", MODES)
def test_a_transactional_step_taken_away_while_its_action_runs_commits_nothing(mode):
    """A TRANSACTIONAL block does not lock the run row before ``run()``: the run may be
    reaped or taken over while its action runs. The fence in the statement that
    journals the step refuses it then, and the block rolls back, the row with it."""
    run, stale, after = stale_attempt("fence.tx", mode, path="ctx.tx", gate_inside=True)
    assert_nothing_committed(run, stale, after)


@pytest.mark.parametrize("mode", MODES)
def test_a_stale_write_in_ctx_fenced_commits_nothing(mode):
    run, stale, after = stale_attempt("fence.fenced", mode, path="fenced")
    assert_nothing_committed(run, stale, after)


@pytest.mark.parametrize("mode", MODES)
def test_a_stale_write_guarded_by_heartbeat_tx_commits_nothing(mode):
    run, stale, after = stale_attempt("fence.heartbeat_tx", mode, path="heartbeat(tx)")
    assert_nothing_committed(run, stale, after)


@pytest.mark.parametrize("mode", MODES)
def test_a_stale_heartbeat_without_tx_raises_and_extends_no_lease(mode):
    run, stale, after = stale_attempt("fence.heartbeat", mode, path="heartbeat()")
    # The row compare includes lease_expires_at: the new holder's lease is untouched.
    assert_nothing_committed(run, stale, after)


@pytest.mark.parametrize("mode", MODES)
def test_a_stale_journal_entry_never_commits(mode):
    # After a reap the run is `queued`: a fence without its status condition
    # would commit this entry into a run nobody holds.
    run, stale, after = stale_attempt("fence.journal", mode, gate_inside=True)
    assert_nothing_committed(run, stale, after)


@pytest.mark.parametrize("mode", MODES)
def test_a_stale_dispatch_writes_no_ledger_entry_and_calls_no_provider(mode):
    run, stale, after = stale_attempt("fence.dispatch", mode)
    assert not LedgerEntry.objects.filter(run=run).exists()
    assert not ProviderCall.objects.exists()
    assert_nothing_committed(run, stale, after)


@pytest.mark.parametrize("mode", MODES)
def test_a_stale_external_result_is_only_late_evidence(mode):
    run, stale, after = stale_attempt("fence.dispatch", mode, gate_inside=True)
    kinds = list(LedgerEntry.objects.filter(run=run).order_by("id").values_list("kind", flat=True))
    assert kinds == ["dispatched", "late_result"]
    assert_nothing_committed(run, stale, after)


@pytest.mark.parametrize("mode", MODES)
def test_a_stale_charge_is_not_committed(mode):
    run, stale, after = stale_attempt("fence.charge", mode)
    assert not BudgetCharge.objects.filter(run=run).exists()
    assert_nothing_committed(run, stale, after)


@pytest.mark.parametrize("mode", MODES)
def test_a_stale_park_does_not_park_the_run(mode):
    run, stale, after = stale_attempt("fence.park", mode)
    assert row_state(run.pk)[0] != "waiting"
    assert_nothing_committed(run, stale, after)


@pytest.mark.parametrize("mode", MODES)
def test_a_stale_finish_does_not_end_the_run(mode):
    run, stale, after = stale_attempt("fence.finish", mode)
    assert row_state(run.pk)[0] != "succeeded"
    # Step 0's success is written with the run's end, in one commit (#13): the
    # fenced-out end commits neither, and the next holder runs the PURE step again.
    assert_nothing_committed(run, stale, after)


@pytest.mark.parametrize("mode", MODES)
def test_a_stale_finish_after_a_journaled_step_does_not_end_the_run(mode):
    run, _, after = stale_attempt("fence.finish_journaled", mode)
    assert row_state(run.pk) == after, "the stale worker changed the run's row"
    assert row_state(run.pk)[0] != "succeeded"
    # Step 0 committed before the run was taken away; nothing after it did.
    assert list(JournalEntry.objects.filter(run=run).values_list("seq", flat=True)) == [0]


@pytest.mark.parametrize("mode", MODES)
def test_a_stale_release_hands_nothing_back(mode):
    run, _ = start("fence.journal", gate_inside=False)
    generation = claim_for_stale_worker(run)
    after = take_away(run, mode, generation)
    assert claim.release("default", run.pk, generation) is False
    assert row_state(run.pk) == after


# -- the row lock: no takeover while a fenced block is open ---------------------------


@pytest.mark.parametrize(("name", "path"), [("fence.fenced", "fenced")], ids=["fenced"])
def test_no_takeover_while_a_fenced_block_is_open(name, path):
    """The fence holds the run row until commit: reaping skips it, so the write that
    passed the fence commits before any other worker can hold the run. (A TRANSACTIONAL
    step's block fences at its end: see the test of a takeover while its action runs.)"""
    run, gate_name = start(name, gate_inside=True, path=path)
    stale = StaleWorker(run, gate_name)
    # Frozen inside the block until its lease runs out (the row is locked: it
    # cannot be expired by hand); a reaper must not take the run now.
    wait_for(lease_expired(run.pk), message="the stale worker's lease to expire")
    reaped = claim.reap_expired("default")
    taken = row_state(run.pk)[:2] != ("running", stale.generation)
    outcome = stale.finish()
    written = DomainRow.objects.filter(generation=stale.generation).exists()
    assert not (taken and written), "a write committed after its run was taken away"
    assert (reaped, taken) == (0, False)
    assert outcome == "succeeded"
    assert written
