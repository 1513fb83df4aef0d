"""``RunEnding`` on its own: each end of a claim, written through its journal, against
PostgreSQL.

Each test claims a run as a worker does (``claim_runs``, then ``preload``), sets up
its ``Execution`` the way ``execute()`` does once loaded, and ends it directly: the
run row, its journal and ledger, its end seal and the claim's ``outcome`` tell what
was written. A takeover is the real one (lease expired, reaped, claimed again).
"""

from __future__ import annotations

from typing import Any

import pgtrigger
import pytest
from django.db import connection, transaction

from k2b_workflows import Dependency, start_workflow_run, store, succeeded
from k2b_workflows.exceptions import LeaseLost, Suspend
from k2b_workflows.kernel import evidence, seals
from k2b_workflows.kernel.ending import Outcome
from k2b_workflows.models import JournalEntry, LedgerEntry, WorkflowRun
from tests.support.kernel import (
    claimed_execution,
    counting_failures,
    fresh,
    journal,
    ledger_kinds,
    new_step,
    requeue_expired,
    take_over,
    writers,
)
from tests.workflows.units import UnitExternal, UnitPure

pytestmark = pytest.mark.django_db(transaction=True)

DISPATCHED = LedgerEntry.Kind.DISPATCHED
SUCCEEDED = LedgerEntry.Kind.SUCCEEDED


def _started() -> tuple[WorkflowRun, Any]:
    run = start_workflow_run("units.plain", {"n": 0})
    return run, claimed_execution(run)


def _pending_success(execution: Any, seq: int, *, external: bool = False) -> None:
    """Step ``seq``'s success, deferred as the journal defers it (an external one after
    its dispatch committed)."""
    j = execution.journal
    if external:
        step = new_step(execution, seq, UnitExternal, invocation=1)
        j.ledger_event(step, DISPATCHED, fenced=True)
        j.journal_success(step, succeeded({"sent": True}), ledger_kind=SUCCEEDED)
    else:
        j.journal_success(new_step(execution, seq, UnitPure), succeeded({"n": seq + 1}))


def _sealed_end(run: WorkflowRun) -> WorkflowRun:
    """The run as stored, its end seal checked."""
    row = fresh(run)
    assert row.end_seal
    assert seals.end_problem(row) is None
    return row


def _db_now_is_before(value: Any) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT k2b_now() < %s", [value])
        return bool(cursor.fetchone()[0])


# -- success -------------------------------------------------------------------


@pytest.mark.parametrize("last", ["pure", "external", "none"])
def test_succeed_writes_the_last_steps_success_and_the_end_in_one_transaction(last):
    run, execution = _started()
    if last != "none":
        _pending_success(execution, 0, external=last == "external")

    # The end leaves the workflow by returning: ``Suspend`` stays inside ``succeed``.
    assert execution.ending.succeed({"n": 1}) is None

    assert execution.outcome == Outcome.SUCCEEDED
    row = _sealed_end(run)
    assert (row.status, row.output, row.error_code, row.consecutive_failures) == (
        "succeeded",
        {"n": 1},
        "",
        0,
    )
    assert row.finished_at is not None and row.lease_expires_at is None
    xmins = writers(run)
    if last == "none":
        assert journal(run) == []
    else:
        assert [(e.seq, e.state) for e in journal(run)] == [(0, "succeeded")]
        assert xmins["journal"] == xmins["run"]  # the step's entry and the end: one commit
        assert execution.journal.pending is None
        assert execution.journal.get(0).state == "succeeded"
    if last == "external":
        assert ledger_kinds(run) == ["dispatched", "succeeded"]
        assert xmins["ledger"][1] == xmins["run"][0]
        assert execution.journal.ledger_head.count == 2
    assert evidence.verify_chains(run.pk, "default") is None


def test_succeed_inside_an_open_transaction_ends_the_run_with_its_success():
    """No batched statements in a caller's transaction: the read and the writes go
    through it, and commit with it."""
    run, execution = _started()
    _pending_success(execution, 0)
    with transaction.atomic():
        execution.ending.succeed({"n": 1})
        assert execution.outcome == Outcome.SUCCEEDED
    row = _sealed_end(run)
    assert (row.status, row.output) == ("succeeded", {"n": 1})
    assert [(e.seq, e.state) for e in journal(run)] == [(0, "succeeded")]
    assert evidence.verify_chains(run.pk, "default") is None


# -- the other ends ------------------------------------------------------------


def test_fail_journals_the_steps_failure_after_the_deferred_success_and_seals_the_end():
    run, execution = _started()
    _pending_success(execution, 0)
    with pytest.raises(Suspend):
        execution.ending.fail("REFUSED", "the provider said no", new_step(execution, 1, UnitPure))
    assert execution.outcome == Outcome.FAILED
    row = _sealed_end(run)
    assert (row.status, row.error_code, row.error_message) == (
        "failed",
        "REFUSED",
        "the provider said no",
    )
    assert row.finished_at is not None and row.lease_expires_at is None
    assert [(e.seq, e.state, e.error_code) for e in journal(run)] == [
        (0, "succeeded", ""),
        (1, "failed", "REFUSED"),
    ]
    xmins = writers(run)
    assert xmins["journal"] == xmins["run"] * 2  # both entries commit with the end
    assert execution.journal.pending is None and execution.journal.get(1).state == "failed"
    assert evidence.verify_chains(run.pk, "default") is None


def test_fail_without_a_step_journals_nothing_of_its_own():
    run, execution = _started()
    with pytest.raises(Suspend):
        execution.ending.fail("UNKNOWN_WORKFLOW", "no workflow")
    row = _sealed_end(run)
    assert (row.status, row.error_code) == ("failed", "UNKNOWN_WORKFLOW")
    assert journal(run) == []


def test_needs_attention_hands_the_run_over_with_its_detail_and_step():
    run, execution = _started()
    with pytest.raises(Suspend):
        execution.ending.needs_attention(
            "RECONCILE_UNKNOWN", "the provider does not know", step=2, detail={"asked": 3}
        )
    assert execution.outcome == Outcome.NEEDS_ATTENTION
    row = _sealed_end(run)
    assert (row.status, row.error_code, row.error_message) == (
        "needs_attention",
        "RECONCILE_UNKNOWN",
        "the provider does not know",
    )
    assert row.error_detail == {"asked": 3}
    assert row.attention_step == 2
    assert row.lease_expires_at is None


def test_retry_later_queues_the_run_after_a_backoff_and_counts_the_failure():
    run, execution = _started()
    WorkflowRun.objects.filter(pk=run.pk).update(consecutive_failures=1)
    execution.run.consecutive_failures = 1
    with pytest.raises(Suspend):
        execution.ending.retry_later("provider hiccup")
    assert execution.outcome == Outcome.RETRY
    row = fresh(run)
    assert (row.status, row.consecutive_failures, row.error_message, row.claimed_by) == (
        "queued",
        2,
        "provider hiccup",
        "",
    )
    assert row.lease_expires_at is None
    assert _db_now_is_before(row.run_after)  # backed off, not due at once
    assert row.generation == execution.generation


def test_a_retry_after_a_steps_success_counts_from_zero_and_keeps_the_success():
    run, execution = _started()
    counting_failures(execution, 3)
    _pending_success(execution, 0)
    with pytest.raises(Suspend):
        execution.ending.retry_later("step 1 raised")
    row = fresh(run)
    assert (row.status, row.consecutive_failures) == ("queued", 1)
    assert [(e.seq, e.state) for e in journal(run)] == [(0, "succeeded")]
    xmins = writers(run)
    assert xmins["journal"] == xmins["run"]


def test_retry_later_past_the_bound_fails_the_run():
    run, execution = _started()
    execution.run.consecutive_failures = store.max_consecutive_failures() - 1
    with pytest.raises(Suspend):
        execution.ending.retry_later("provider hiccup")
    assert execution.outcome == Outcome.FAILED
    row = _sealed_end(run)
    assert (row.status, row.error_code) == ("failed", store.WORKFLOW_RETRY_EXHAUSTED)
    assert row.error_message.endswith("last: provider hiccup")


def test_exhausted_with_an_open_external_step_goes_to_an_operator():
    """A dispatch with no known outcome, read at the next claim: the effect may have
    happened, so the run is never simply failed."""
    run, first = _started()
    first.journal.journal_success(new_step(first, 0, UnitPure), succeeded({"n": 1}))
    first.journal.flush_pending()
    dispatch = new_step(first, 1, UnitExternal, invocation=1)
    first.journal.ledger_event(dispatch, DISPATCHED, fenced=True)
    requeue_expired(run)  # the worker crashed in the call
    execution = claimed_execution(run)
    assert execution.journal.open_steps() == [1]

    with pytest.raises(Suspend):
        execution.ending.exhausted(5, "worker lost")
    assert execution.outcome == Outcome.NEEDS_ATTENTION
    row = _sealed_end(run)
    assert (row.status, row.error_code, row.attention_step) == (
        "needs_attention",
        store.WORKFLOW_RETRY_EXHAUSTED,
        1,
    )
    assert row.error_message == "5 consecutive failures; last: worker lost"


def test_exhausted_without_an_open_step_fails_the_run():
    run, first = _started()
    dispatch = new_step(first, 0, UnitExternal, invocation=1)
    first.journal.ledger_event(dispatch, DISPATCHED, fenced=True)
    first.journal.ledger_event(dispatch, LedgerEntry.Kind.FAILED, fenced=True)
    requeue_expired(run)
    execution = claimed_execution(run)
    assert execution.journal.open_steps() == []

    with pytest.raises(Suspend):
        execution.ending.exhausted(5, "worker lost")
    assert execution.outcome == Outcome.FAILED
    row = _sealed_end(run)
    assert (row.status, row.error_code, row.attention_step) == (
        "failed",
        store.WORKFLOW_RETRY_EXHAUSTED,
        None,
    )


def test_park_records_the_providers_pending_answer_and_parks_the_run():
    run, first = _started()
    dispatch = new_step(first, 0, UnitExternal, invocation=1)
    first.journal.ledger_event(dispatch, DISPATCHED, fenced=True)
    requeue_expired(run)
    execution = claimed_execution(run)
    step = new_step(execution, 0, UnitExternal, invocation=1)
    with pytest.raises(Suspend):
        execution.ending.park(
            0,
            step.name,
            Dependency(kind="provider", key="order-1"),
            pending=(step, "pending: waiting on provider/order-1"),
        )
    assert execution.outcome == Outcome.WAITING
    row = fresh(run)
    assert (row.status, row.wait_kind, row.wait_key, row.wait_step, row.wait_action) == (
        "waiting",
        "provider",
        "order-1",
        0,
        "units.external",
    )
    assert ledger_kinds(run) == ["dispatched", "pending"]
    assert LedgerEntry.objects.get(run=run, kind="pending").generation == execution.generation
    assert evidence.verify_chains(run.pk, "default") is None


def test_a_park_after_a_takeover_writes_nothing():
    run, execution = _started()
    step = new_step(execution, 0, UnitExternal, invocation=1)
    new_generation = take_over(run)
    with pytest.raises(LeaseLost):
        execution.ending.park(0, step.name, Dependency(kind="provider", key="order-1"), (step, "p"))
    row = fresh(run)
    assert (row.status, row.generation, row.wait_kind) == ("running", new_generation, "")
    assert ledger_kinds(run) == []


# -- after a takeover ----------------------------------------------------------

_ENDS = {
    "succeed": lambda ending: ending.succeed({"n": 1}),
    "fail": lambda ending: ending.fail("REFUSED", "no"),
    "needs_attention": lambda ending: ending.needs_attention("X", "why", step=None),
    "retry_later": lambda ending: ending.retry_later("hiccup"),
}


@pytest.mark.parametrize("end", sorted(_ENDS))
def test_an_end_after_a_takeover_raises_lease_lost_and_writes_nothing(end):
    run, execution = _started()
    _pending_success(execution, 0)
    new_generation = take_over(run)
    before = fresh(run)

    with pytest.raises(LeaseLost):
        _ENDS[end](execution.ending)
    after = fresh(run)
    assert (after.status, after.generation, after.claimed_by, after.updated_at) == (
        "running",
        new_generation,
        "new-holder",
        before.updated_at,
    )
    assert (after.error_code, after.end_seal, after.output) == ("", "", None)
    assert journal(run) == [] and ledger_kinds(run) == []
    assert execution.outcome == Outcome.DROPPED  # not ended by this claim


@pytest.mark.parametrize("end", ["succeed", "fail"])
def test_an_external_success_lost_with_the_end_is_kept_as_late_evidence(end):
    run, execution = _started()
    _pending_success(execution, 0, external=True)
    take_over(run)
    with pytest.raises(LeaseLost):
        _ENDS[end](execution.ending)
    assert ledger_kinds(run) == ["dispatched", "late_result"]
    assert journal(run) == []
    assert fresh(run).status == "running"
    assert evidence.verify_chains(run.pk, "default") is None


# -- as written, as read ---------------------------------------------------------


@pytest.mark.parametrize("deferred", [True, False], ids=["with_success", "alone"])
def test_the_end_as_written_refuses_chains_someone_else_wrote_to_and_the_read_ends_it(deferred):
    """A ledger entry this execution did not append (a fenced-out worker's late
    result): chains still sound, but not as written. Nothing is written until the
    end that reads and verifies them. Alone, the end's statement matches no row
    rather than failing: that too is a refusal."""
    run, execution = _started()
    if deferred:
        _pending_success(execution, 0)
    with transaction.atomic():
        evidence.append_ledger(
            "default", run_id=run.pk, seq=0, kind="late_result", message="a note"
        )
    pending = execution.journal.pending

    assert execution.ending.end_as_written({"n": 1}, pending) is False
    assert (fresh(run).status, fresh(run).end_seal) == ("running", "")
    assert journal(run) == []

    assert execution.ending.end_as_read({"n": 1}, pending) is True
    row = _sealed_end(run)
    assert (row.status, row.output) == ("succeeded", {"n": 1})
    assert [(e.seq, e.state) for e in journal(run)] == ([(0, "succeeded")] if deferred else [])
    assert evidence.verify_chains(run.pk, "default") is None


def test_the_end_as_written_ends_the_run_when_the_chains_are_as_written():
    run, execution = _started()
    _pending_success(execution, 0)
    assert execution.ending.end_as_written({"n": 1}, execution.journal.pending) is True
    assert fresh(run).status == "succeeded"
    assert [(e.seq, e.state) for e in journal(run)] == [(0, "succeeded")]


def _tamper_step_zero(run: WorkflowRun) -> None:
    """An attacker edits step 0's output in place (trigger bypassed, hashes left)."""
    with pgtrigger.ignore("k2b_workflows.JournalEntry:journal_append_only"):
        JournalEntry.objects.filter(run_id=run.pk, seq=0).update(output={"n": 999})


def _tampered() -> tuple[WorkflowRun, Any]:
    run, execution = _started()
    _pending_success(execution, 0)
    execution.journal.flush_pending()
    _pending_success(execution, 1)
    _tamper_step_zero(run)
    return run, execution


def test_the_end_as_written_refuses_a_journal_missing_an_entry_it_wrote():
    """An entry deleted behind the execution's back (trigger bypassed) leaves the run
    row's anchor and length as they were and no row version to compare: the count
    of the entries is what refuses the end; the read then finds the break."""
    run, execution = _started()
    _pending_success(execution, 0)
    execution.journal.flush_pending()
    _pending_success(execution, 1)
    with pgtrigger.ignore("k2b_workflows.JournalEntry:journal_append_only"):
        JournalEntry.objects.filter(run_id=run.pk, seq=0).delete()
    pending = execution.journal.pending
    assert execution.ending.end_as_written({"n": 2}, pending) is False
    assert (fresh(run).status, journal(run)) == ("running", [])
    with pytest.raises(Suspend):
        execution.ending.end_as_read({"n": 2}, pending)
    assert execution.outcome == Outcome.NEEDS_ATTENTION


def test_the_end_as_read_finds_a_tampered_entry_and_hands_the_run_over():
    run, execution = _tampered()
    pending = execution.journal.pending
    assert execution.ending.end_as_written({"n": 2}, pending) is False
    assert fresh(run).status == "running"
    assert len(journal(run)) == 1

    with pytest.raises(Suspend):
        execution.ending.end_as_read({"n": 2}, pending)
    assert execution.outcome == Outcome.NEEDS_ATTENTION
    row = _sealed_end(run)
    assert (row.status, row.error_code) == ("needs_attention", store.INTEGRITY_CHAIN_BROKEN)
    assert "journal" in row.error_message
    assert row.output is None
    # The deferred success goes with the incident, after the entry that broke.
    assert [(e.seq, e.state) for e in journal(run)] == [(0, "succeeded"), (1, "succeeded")]


def test_succeed_on_a_tampered_journal_ends_in_needs_attention():
    run, execution = _tampered()
    assert execution.ending.succeed({"n": 2}) is None
    assert execution.outcome == Outcome.NEEDS_ATTENTION
    row = _sealed_end(run)
    assert (row.status, row.error_code) == ("needs_attention", store.INTEGRITY_CHAIN_BROKEN)
