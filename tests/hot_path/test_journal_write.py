"""The fenced one-statement journal write: it refuses a stale generation, a canceled
run and an entry that is not the journal's next, and it updates the run row in place."""

from __future__ import annotations

import pytest
from django.db import connection

from k2b_workflows import start_workflow_run
from k2b_workflows.exceptions import LeaseLost, RunCanceled
from k2b_workflows.kernel import evidence
from k2b_workflows.models import WorkflowRun
from tests.hot_path.helpers import _entry, _run_table_counts
from tests.support.kernel import claim_for, fresh, journal

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_one_statement_journal_write_refuses_a_stale_generation():
    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    generation = claim_for(run)
    with pytest.raises(LeaseLost):
        evidence.append_journal_fenced(
            _entry(run, generation - 1), evidence.GENESIS, "default", lease_ms=30_000
        )
    assert journal(run) == []

    written = evidence.append_journal_fenced(
        _entry(run, generation), evidence.GENESIS, "default", lease_ms=30_000
    )
    stored = journal(run)
    assert [e.pk for e in stored] == [written.pk]
    assert stored[0].output == {"n": 1}
    assert evidence.verify_chains(run.pk, "default") is None
    assert fresh(run).current_step == 0


def test_the_one_statement_journal_write_refuses_an_entry_that_is_not_the_next():
    """The run row's journal length is the append's guard, the run's end included: a
    step written again (a write retried after its commit went through) or past a gap
    inserts nothing, and the chains stay as they were."""
    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    generation = claim_for(run)
    first = evidence.append_journal_fenced(
        _entry(run, generation), evidence.GENESIS, "default", lease_ms=30_000
    )
    assert fresh(run).journal_length == 1
    ahead = _entry(run, generation)
    ahead.seq = 2
    for entry in (_entry(run, generation), ahead):
        with pytest.raises(LeaseLost):
            evidence.append_journal_fenced(entry, first.entry_hash, "default", lease_ms=30_000)
        sql, params = evidence.fenced_journal_statement(
            entry, first.entry_hash, run_output="1", end_seal="sealed"
        )
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            assert cursor.fetchone() is None  # the end matched no row
    assert [e.pk for e in journal(run)] == [first.pk]
    assert (fresh(run).status, fresh(run).journal_length) == ("running", 1)
    assert evidence.verify_chains(run.pk, "default") is None


def test_the_one_statement_journal_write_refuses_a_canceled_run():
    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    generation = claim_for(run)
    WorkflowRun.objects.filter(pk=run.pk).update(status="canceled")
    with pytest.raises(RunCanceled):
        evidence.append_journal_fenced(
            _entry(run, generation), evidence.GENESIS, "default", lease_ms=30_000
        )
    assert journal(run) == []


def test_a_steps_fence_and_journal_write_update_the_run_row_in_place():
    """Neither changes an indexed column of ``k2b_run`` (migration 0010), so both are
    HOT updates: no new entry in any of the table's nine indexes, a step at a time."""
    from django.db import transaction

    from k2b_workflows.kernel import db

    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    generation = claim_for(run)
    counts = ("tuples_updated", "tuples_hot_updated")
    with transaction.atomic():
        (updated, hot) = _run_table_counts(*counts)
        db.fence("default", run.pk, generation, 30_000, 0)
        evidence.append_journal_fenced(
            _entry(run, generation), evidence.GENESIS, "default", lease_ms=30_000
        )
        assert _run_table_counts(*counts) == (updated + 2, hot + 2)
