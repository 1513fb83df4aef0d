"""``RunJournal`` and ``Batch`` on their own: a claimed run's journal and ledger state, and
every write to them, against PostgreSQL.

Each test claims a run as a worker does (``claim_runs``, then ``preload``) and sets
up its ``Execution`` the way ``execute()`` does once loaded, then calls the journal
directly with steps built as ``Execution`` builds them. A takeover is the real one
(lease expired, reaped, claimed again by another worker), as in ``test_fence.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, transaction

from k2b_workflows import start_workflow_run, store, succeeded
from k2b_workflows.exceptions import LeaseLost, RunCanceled, StepFailed
from k2b_workflows.kernel import evidence
from k2b_workflows.kernel.journal import Batch, EffectState, RunJournal
from k2b_workflows.kernel.load import Preloaded, preload
from k2b_workflows.models import BudgetCharge, LedgerEntry, WorkflowRun
from tests.support.kernel import (
    claimed_execution,
    counting_failures,
    fresh,
    journal,
    ledger_kinds,
    new_step,
    take_over,
    writers,
)
from tests.workflows.units import UnitExternal, UnitPure

pytestmark = pytest.mark.django_db(transaction=True)

DISPATCHED = LedgerEntry.Kind.DISPATCHED
SUCCEEDED = LedgerEntry.Kind.SUCCEEDED


def _versions(table: str, run: WorkflowRun, order: str) -> list[str]:
    """Each entry's ``id:xmin``, as ``evidence.row_version`` and ``AS_WRITTEN_CHECK`` spell it."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id || ':' || xmin::text FROM {table} WHERE run_id = %s ORDER BY {order}",
            [run.pk],
        )
        return [row[0] for row in cursor.fetchall()]


def _ledger(run: WorkflowRun) -> list[LedgerEntry]:
    return list(LedgerEntry.objects.filter(run=run).order_by("id"))


def _someone_else_appends(run: WorkflowRun, seq: int = 0) -> LedgerEntry:
    """A ledger entry this execution did not write (as a fenced-out worker's late result)."""
    with transaction.atomic():
        return evidence.append_ledger(
            "default", run_id=run.pk, seq=seq, kind="late_result", message="a note"
        )


def _started() -> tuple[WorkflowRun, Any]:
    run = start_workflow_run("units.plain", {"n": 0})
    return run, claimed_execution(run)


# -- load ----------------------------------------------------------------------


def test_load_takes_entries_hashes_ledger_head_and_each_steps_effect_from_a_read():
    run, execution = _started()
    j = execution.journal
    assert (j.entries, j.last_hash, j.effects) == ({}, evidence.GENESIS, {})
    assert (j.ledger_head.count, j.ledger_head.head, j.ledger_head.versions) == (0, None, [])
    # Steps 0 and 1 journaled; step 1 had an external effect, closed by its entry.
    j.ledger_event(new_step(execution, 1, UnitExternal, invocation=1), DISPATCHED, fenced=True)
    for seq in (0, 1):
        j.journal_success(new_step(execution, seq, UnitPure), succeeded({"n": seq}))
    j.flush_pending()

    def event(seq: int, kind: str, invocation: int) -> None:
        step = new_step(execution, seq, UnitExternal, invocation=invocation)
        j.ledger_event(step, kind, fenced=True)

    event(2, DISPATCHED, 1)  # open, answered "pending" twice
    event(2, LedgerEntry.Kind.PENDING, 1)
    event(2, LedgerEntry.Kind.PENDING, 1)
    event(3, DISPATCHED, 1)  # closed by its outcome
    event(3, SUCCEEDED, 1)
    event(4, DISPATCHED, 1)  # polled, failed, dispatched again: open, no polls since
    event(4, LedgerEntry.Kind.PENDING, 1)
    event(4, LedgerEntry.Kind.FAILED, 1)
    event(4, DISPATCHED, 2)
    with transaction.atomic():  # an entry of no step: the run's, not an effect's
        evidence.append_ledger("default", run_id=run.pk, seq=None, kind="late_result")

    loaded = preload("default", [run.pk])[run.pk]
    again = RunJournal(execution, loaded)

    stored = journal(run)
    assert sorted(again.entries) == [0, 1]
    assert [again.get(seq).entry_hash for seq in (0, 1)] == [e.entry_hash for e in stored]
    assert again.get(2) is None
    assert again.last_hash == stored[-1].entry_hash
    ledger = _ledger(run)
    assert again.ledger_head.count == len(ledger) == 11
    assert again.ledger_head.head == ledger[-1].entry_hash
    assert again.ledger_head.versions == _versions("k2b_ledger", run, "id")
    row = fresh(run)
    assert again.loaded_anchors == {
        "journal": (2, row.journal_anchor),
        "ledger": (11, row.ledger_anchor),
    }
    assert again.effects == {
        2: EffectState(attempts=1, open_key=f"{run.pk}:2:1", polls=2),
        3: EffectState(attempts=1, open_key=None, polls=0),
        4: EffectState(attempts=2, open_key=f"{run.pk}:4:2", polls=0),
    }
    assert again.open_steps() == [2, 4]
    # ``load`` on an existing journal replaces what it knew, effects included.
    j.load(loaded)
    assert j.effects == again.effects and j.last_hash == again.last_hash


# -- the deferred success ----------------------------------------------------


def test_a_success_waits_for_the_next_write_then_commits_fenced_and_applied():
    run, execution = _started()
    counting_failures(execution, 2)
    j = execution.journal
    step0 = new_step(execution, 0, UnitPure, {"n": 0})

    output = j.journal_success(step0, succeeded({"n": 1}))
    assert output == {"n": 1}
    output["n"] = 99  # the caller's copy, not the entry to be written
    assert journal(run) == []  # nothing in the database yet
    assert j.pending is not None and j.pending.entry.output == {"n": 1}
    assert j.entries == {} and j.last_hash == evidence.GENESIS
    assert execution.run.consecutive_failures == 0  # as the flush will make the row
    assert fresh(run).consecutive_failures == 2

    # A PURE step after it: its success joins the deferred one, nothing is written.
    j.journal_success(new_step(execution, 1, UnitPure, {"n": 1}), succeeded({"n": 2}))
    assert journal(run) == []
    assert j.pending is not None and j.pending.step.seq == 1
    assert [e.seq for e in j.pending.entries] == [0, 1]
    assert j.entries == {} and fresh(run).consecutive_failures == 2

    # The next write carries both, in order, in one fenced statement.
    j.flush_pending()
    stored = journal(run)
    assert [(e.seq, e.state, e.generation) for e in stored] == [
        (0, "succeeded", execution.generation),
        (1, "succeeded", execution.generation),
    ]
    assert stored[0].output == {"n": 1} and stored[1].output == {"n": 2}
    assert stored[1].prev_hash == stored[0].entry_hash
    assert len(set(writers(run)["journal"])) == 1  # one commit
    assert fresh(run).consecutive_failures == 0
    assert j.pending is None
    assert sorted(j.entries) == [0, 1] and j.last_hash == stored[1].entry_hash
    assert fresh(run).current_step == 1
    assert evidence.verify_chains(run.pk, "default") is None
    j.flush_pending()  # nothing pending: nothing written
    assert len(journal(run)) == 2


def test_a_success_that_is_not_pure_is_written_before_the_next_step_runs():
    """Only PURE successes ride past a step: an EXTERNAL one (or IDEMPOTENT) is written by
    the next step's start, and the PURE step after it waits alone."""
    run, execution = _started()
    j = execution.journal
    step = new_step(execution, 0, UnitExternal, invocation=1)
    j.ledger_event(step, DISPATCHED, fenced=True)
    j.effects[0] = EffectState(attempts=1, open_key=step.ctx.invocation_key)
    j.journal_success(step, succeeded({"sent": True}), ledger_kind=SUCCEEDED)
    assert not j.rides(UnitPure())
    j.journal_success(new_step(execution, 1, UnitPure, {"n": 1}), succeeded({"n": 2}))
    assert [e.seq for e in journal(run)] == [0]
    assert j.pending is not None and [e.seq for e in j.pending.entries] == [1]
    assert j.rides(UnitPure()) and not j.rides(UnitExternal())


def test_pure_successes_ride_on_one_write_up_to_a_bound():
    """A long loop of PURE steps commits every ``MAX_RIDING + 1`` steps, not once a step
    and not in one statement of unbounded size."""
    from k2b_workflows.kernel.journal import MAX_RIDING

    run, execution = _started()
    j = execution.journal
    for seq in range(MAX_RIDING + 2):
        j.journal_success(new_step(execution, seq, UnitPure, {"n": seq}), succeeded({"n": seq}))
    assert len(journal(run)) == MAX_RIDING + 1
    assert j.pending is not None and [e.seq for e in j.pending.entries] == [MAX_RIDING + 1]
    j.flush_pending()
    assert evidence.verify_chains(run.pk, "default") is None


def test_an_external_success_flushes_with_its_ledger_entry_in_one_transaction():
    run, execution = _started()
    j = execution.journal
    step = new_step(execution, 0, UnitExternal, invocation=1)
    j.ledger_event(step, DISPATCHED, fenced=True)
    j.effects[0] = EffectState(attempts=1, open_key=step.ctx.invocation_key)
    j.journal_success(step, succeeded({"sent": True}), ledger_kind=SUCCEEDED)
    assert 0 not in j.effects  # closed by the success, as the entry will close it
    assert ledger_kinds(run) == ["dispatched"] and journal(run) == []

    j.flush_pending()
    assert ledger_kinds(run) == ["dispatched", "succeeded"]
    ledger = _ledger(run)
    assert ledger[1].output_hash == evidence.hash_value({"sent": True})
    assert ledger[1].invocation_key == step.ctx.invocation_key
    xmins = writers(run)
    assert xmins["journal"] == [xmins["ledger"][1]]  # one commit for both
    assert j.ledger_head.count == 2 and j.ledger_head.head == ledger[1].entry_hash
    assert j.pending is None and j.get(0).state == "succeeded"
    assert evidence.verify_chains(run.pk, "default") is None


@pytest.mark.parametrize("taken", ["over", "canceled"])
def test_a_flush_after_the_run_was_taken_commits_nothing(taken):
    """A PURE step's result is computed again by the new holder: nothing to keep."""
    run, execution = _started()
    j = execution.journal
    j.journal_success(new_step(execution, 0, UnitPure), succeeded({"n": 1}))
    if taken == "over":
        new_generation = take_over(run)
        expected: type[Exception] = LeaseLost
    else:
        WorkflowRun.objects.filter(pk=run.pk).update(status="canceled")
        new_generation = execution.generation
        expected = RunCanceled
    before = fresh(run)

    with pytest.raises(expected):
        j.flush_pending()
    assert journal(run) == []
    assert _ledger(run) == []  # no late evidence of a PURE step
    assert j.entries == {} and j.last_hash == evidence.GENESIS
    after = fresh(run)
    assert (after.generation, after.status, after.current_step, after.updated_at) == (
        new_generation,
        before.status,
        before.current_step,
        before.updated_at,
    )


def test_an_external_result_the_run_lost_is_kept_as_late_evidence():
    run, execution = _started()
    j = execution.journal
    step = new_step(execution, 0, UnitExternal, invocation=1)
    j.ledger_event(step, DISPATCHED, fenced=True)
    output = {"sent": True, "card": "4111111111111111"}
    j.journal_success(step, succeeded(output), ledger_kind=SUCCEEDED)
    new_generation = take_over(run)

    with pytest.raises(LeaseLost):
        j.flush_pending()
    assert journal(run) == []
    assert ledger_kinds(run) == ["dispatched", "late_result"]
    late = _ledger(run)[1]
    assert (late.seq, late.generation) == (0, execution.generation)
    assert late.output_hash == evidence.hash_value(output)
    assert "taken over" in late.message
    assert late.detail == {"output": evidence.redacted_summary(output), "outcome": "succeeded"}
    assert "4111111111111111" not in str(late.detail)
    assert fresh(run).generation == new_generation
    assert evidence.verify_chains(run.pk, "default") is None


# -- failures and charges ----------------------------------------------------


def test_a_step_failure_is_journaled_after_the_deferred_success_and_raised():
    run, execution = _started()
    counting_failures(execution, 3)
    j = execution.journal
    j.journal_success(new_step(execution, 0, UnitPure), succeeded({"n": 1}))

    with pytest.raises(StepFailed) as failed:
        j.step_failed(new_step(execution, 1, UnitPure), "REFUSED", "the provider said no")
    assert failed.value.code == "REFUSED"
    assert [(e.seq, e.state, e.error_code, e.error_message) for e in journal(run)] == [
        (0, "succeeded", "", ""),
        (1, "failed", "REFUSED", "the provider said no"),
    ]
    assert j.pending is None and j.get(1).state == "failed"
    assert j.last_hash == journal(run)[1].entry_hash
    assert fresh(run).consecutive_failures == 0
    # With nothing deferred before it, the failure's own fence resets the count: a
    # journaled failure is a completed step.
    # (A second reset in one claim: the kernel prepares one per claim, as it loaded
    # the run; this stands for another claim.)
    counting_failures(execution, 3)
    with pytest.raises(StepFailed):
        j.step_failed(new_step(execution, 2, UnitPure), "REFUSED", "again")
    assert [e.seq for e in journal(run)] == [0, 1, 2]
    assert fresh(run).consecutive_failures == 0
    assert execution.run.consecutive_failures == 0
    assert evidence.verify_chains(run.pk, "default") is None


def test_a_charge_is_written_with_its_entry_and_over_the_budget_fails_the_step():
    run = start_workflow_run("units.budgeted", {"n": 0})
    execution = claimed_execution(run)
    j = execution.journal
    within = new_step(execution, 0, UnitPure)
    within.cost = {"emails": 2}
    assert j.journal_success(within, succeeded({"n": 1}), charge=True) == {"n": 1}
    assert j.pending is None  # a charge is never deferred
    assert [(e.seq, e.state) for e in journal(run)] == [(0, "succeeded")]
    charges = BudgetCharge.objects.filter(run_id=run.pk)
    assert [(c.seq, c.unit, c.amount) for c in charges] == [(0, "emails", 2)]

    over = new_step(execution, 1, UnitPure)
    over.cost = {"emails": 2}  # 4 of 3
    with pytest.raises(StepFailed) as failed:
        j.journal_success(over, succeeded({"n": 2}), charge=True)
    assert failed.value.code == store.EFFECT_BUDGET_EXCEEDED
    assert [(e.seq, e.state, e.error_code) for e in journal(run)] == [
        (0, "succeeded", ""),
        (1, "failed", store.EFFECT_BUDGET_EXCEEDED),
    ]
    assert BudgetCharge.objects.filter(run_id=run.pk, seq=1).count() == 0
    assert evidence.verify_chains(run.pk, "default") is None


# -- the ledger ----------------------------------------------------------------


def test_ledger_entries_are_appended_chained_and_move_the_head():
    run, execution = _started()
    j = execution.journal
    step = new_step(execution, 0, UnitExternal, invocation=1)
    j.ledger_event(step, DISPATCHED, message="sent", fenced=True)
    first = _ledger(run)
    assert [(e.seq, e.kind, e.message, e.invocation_key) for e in first] == [
        (0, "dispatched", "sent", f"{run.pk}:0:1")
    ]
    assert first[0].prev_hash == evidence.GENESIS
    assert (j.ledger_head.count, j.ledger_head.head) == (1, first[0].entry_hash)
    assert j.ledger_end() == (1, first[0].entry_hash)

    with transaction.atomic():
        j.fence(0)
        j.ledger(step, SUCCEEDED, output_hash=evidence.hash_value({"sent": True}))
    ledger = _ledger(run)
    assert [e.kind for e in ledger] == ["dispatched", "succeeded"]
    assert ledger[1].prev_hash == ledger[0].entry_hash
    assert (j.ledger_head.count, j.ledger_head.head) == (2, ledger[1].entry_hash)
    assert j.ledger_head.versions == _versions("k2b_ledger", run, "id")
    assert evidence.verify_chains(run.pk, "default") is None


def test_a_fenced_ledger_event_after_a_takeover_writes_nothing():
    run, execution = _started()
    j = execution.journal
    step = new_step(execution, 0, UnitExternal, invocation=1)
    take_over(run)
    with pytest.raises(LeaseLost):
        j.ledger_event(step, DISPATCHED, fenced=True)
    assert _ledger(run) == [] and j.ledger_head.count == 0
    # Unfenced (evidence of what happened, such as a late answer), it is kept.
    j.ledger_event(step, LedgerEntry.Kind.LATE_RESULT, message="late", fenced=False)
    assert ledger_kinds(run) == ["late_result"]
    assert evidence.verify_chains(run.pk, "default") is None


def test_a_ledger_append_on_a_stale_head_reads_the_end_and_still_chains():
    run, execution = _started()
    j = execution.journal
    step = new_step(execution, 0, UnitExternal, invocation=1)
    note = _someone_else_appends(run)
    with transaction.atomic():
        j.fence(0)
        j.ledger(step, DISPATCHED)
    ledger = _ledger(run)
    assert [e.kind for e in ledger] == ["late_result", "dispatched"]
    assert ledger[1].prev_hash == note.entry_hash
    assert (j.ledger_head.count, j.ledger_head.head) == (2, ledger[1].entry_hash)
    assert evidence.verify_chains(run.pk, "default") is None


def _batch_with_dispatch(execution: Any, step: Any) -> Batch:
    batch = Batch(execution.journal, step.seq)
    batch.ledger(step, DISPATCHED, with_hashes=True)
    return batch


def test_a_batch_on_a_stale_ledger_head_writes_nothing_and_one_on_a_fresh_head_commits():
    run, execution = _started()
    j = execution.journal
    step = new_step(execution, 0, UnitExternal, invocation=1)
    stale = _batch_with_dispatch(execution, step)
    note = _someone_else_appends(run)
    before = fresh(run)

    assert stale.commit() is False
    assert _ledger(run) == [note]
    assert (j.ledger_head.count, j.ledger_head.head) == (0, None)
    after = fresh(run)  # not even the batch's fence committed
    assert (after.current_step, after.lease_expires_at, after.updated_at) == (
        before.current_step,
        before.lease_expires_at,
        before.updated_at,
    )

    j.load(preload("default", [run.pk])[run.pk])
    assert (j.ledger_head.count, j.ledger_head.head) == (1, note.entry_hash)
    batch = _batch_with_dispatch(execution, step)
    assert batch.commit() is True
    ledger = _ledger(run)
    assert [e.kind for e in ledger] == ["late_result", "dispatched"]
    assert ledger[1].prev_hash == note.entry_hash
    assert ledger[1].definition_hash == UnitExternal.definition_hash()
    assert (j.ledger_head.count, j.ledger_head.head) == (2, ledger[1].entry_hash)
    assert j.ledger_head.versions == _versions("k2b_ledger", run, "id")
    assert fresh(run).current_step == 0  # the fence the batch carried
    assert evidence.verify_chains(run.pk, "default") is None


def test_a_batch_after_a_takeover_writes_nothing():
    """Refused by its fence: the fence's error, not the writes again one at a time (#51)."""
    run, execution = _started()
    step = new_step(execution, 0, UnitExternal, invocation=1)
    batch = _batch_with_dispatch(execution, step)
    take_over(run)
    with pytest.raises(LeaseLost):
        batch.commit()
    assert _ledger(run) == [] and execution.journal.ledger_head.count == 0


def test_a_batch_carries_a_deferred_external_success_after_its_ledger_entry():
    run, execution = _started()
    j = execution.journal
    step = new_step(execution, 0, UnitExternal, invocation=1)
    j.ledger_event(step, DISPATCHED, fenced=True)
    j.journal_success(step, succeeded({"sent": True}), ledger_kind=SUCCEEDED)
    batch = Batch(j, 0, reset_failures=True)
    batch.pending(j.pending)
    assert batch.commit() is True
    j.pending_committed(j.pending)
    assert ledger_kinds(run) == ["dispatched", "succeeded"]
    xmins = writers(run)
    assert xmins["journal"] == [xmins["ledger"][1]] == xmins["run"]
    assert j.get(0).state == "succeeded" and j.pending is None
    assert evidence.row_version(j.get(0)) == _versions("k2b_journal", run, "seq")[0]
    assert evidence.verify_chains(run.pk, "default") is None


# -- the chains as written -----------------------------------------------------


def test_written_chains_after_a_claim_are_the_stored_versions_and_anchors():
    run, execution = _started()
    j = execution.journal
    j.ledger_event(new_step(execution, 0, UnitExternal, invocation=1), DISPATCHED, fenced=True)
    j.journal_success(new_step(execution, 0, UnitPure), succeeded({"n": 1}))
    j.flush_pending()
    # As this execution wrote them...
    chains = j.written_chains()
    assert chains is not None
    row = fresh(run)
    assert chains.run_id == run.pk
    assert chains.journal_versions == _versions("k2b_journal", run, "seq")
    assert chains.ledger_versions == _versions("k2b_ledger", run, "id")
    assert (chains.journal_anchor, chains.ledger_anchor) == (row.journal_anchor, row.ledger_anchor)
    # ... and as the next claim's preload read them.
    again = RunJournal(execution, preload("default", [run.pk])[run.pk])
    assert again.written_chains() == chains


def test_written_chains_are_unknown_without_every_entrys_row_version():
    run, execution = _started()
    j = execution.journal
    j.journal_success(new_step(execution, 0, UnitPure), succeeded({"n": 1}))
    j.flush_pending()
    # Entries read by the ORM carry no row version.
    read = Preloaded(fresh(run), journal(run), _ledger(run))
    assert RunJournal(execution, read).written_chains() is None
    # A ledger append whose head was stale re-reads the end: its version is not known.
    _someone_else_appends(run)
    with transaction.atomic():
        j.fence(1)
        j.ledger(new_step(execution, 1, UnitExternal, invocation=1), DISPATCHED)
    assert j.ledger_head.versions is None
    assert j.written_chains() is None
