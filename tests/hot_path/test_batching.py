"""A step's writes merged into few commits: a run's end with its last step, a
deferred success with the next step's transaction, and batched transactions that
write all or nothing and leave the connection usable."""

from __future__ import annotations

import pytest
from django.db import connection

from k2b_workflows import start_workflow_run, wake_workflow_runs_waiting_on
from k2b_workflows.kernel import evidence
from k2b_workflows.kernel.ending import RunEnding
from k2b_workflows.kernel.execute import Execution
from tests.hot_path.helpers import _ledger
from tests.hot_path.workflows import committed_hooks
from tests.models import DomainRow
from tests.support.kernel import (
    assert_closed_as_never_sent,
    claim_for,
    fresh,
    journal,
    run_to_end,
)

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_pure_runs_steps_ride_on_its_end():
    """Three PURE steps and the end: one write transaction holds the three entries and
    the end (a PURE step's success rides on the run's next write)."""
    run = start_workflow_run("hot.three_pure", {"n": 0})
    generation = claim_for(run)
    assert Execution(run.pk, generation).execute() == "succeeded"
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT xmin::text FROM k2b_journal WHERE run_id = %s ORDER BY seq", [run.pk]
        )
        steps = [row[0] for row in cursor.fetchall()]
        cursor.execute("SELECT xmin::text FROM k2b_run WHERE id = %s", [run.pk])
        (end,) = cursor.fetchone()
    assert steps == [end] * 3  # one commit, the run's end
    assert fresh(run).status == "succeeded"
    assert fresh(run).output == {"n": 3}
    assert evidence.verify_chains(run.pk, "default") is None


def test_pure_successes_ride_on_a_park():
    """Two PURE steps, then a step that waits: their entries commit with the park, in
    one transaction, and the woken run replays them without running them again."""
    run = start_workflow_run("hot.pure_then_wait", {"n": 0})
    assert Execution(run.pk, claim_for(run)).execute() == "waiting"
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT seq, xmin::text FROM k2b_journal WHERE run_id = %s ORDER BY seq", [run.pk]
        )
        entries = cursor.fetchall()
        cursor.execute("SELECT xmin::text FROM k2b_run WHERE id = %s", [run.pk])
        (parked,) = cursor.fetchone()
    assert entries == [(0, parked), (1, parked)]
    assert fresh(run).status == "waiting"
    assert evidence.verify_chains(run.pk, "default") is None


def test_an_external_dispatch_commits_the_previous_steps_success_before_the_call():
    """The deferred success of step 0 rides in step 1's dispatch: one commit, not two,
    and committed before the provider is called."""
    run = start_workflow_run("hot.pure_then_external", {})
    generation = claim_for(run)
    assert Execution(run.pk, generation).execute() == "succeeded"
    assert fresh(run).output == {"journaled_before_call": 1}
    with connection.cursor() as cursor:
        cursor.execute("SELECT xmin::text FROM k2b_journal WHERE run_id = %s AND seq = 0", [run.pk])
        (step0,) = cursor.fetchone()
        cursor.execute(
            "SELECT xmin::text FROM k2b_ledger WHERE run_id = %s AND kind = 'dispatched'", [run.pk]
        )
        (dispatch,) = cursor.fetchone()
    assert step0 == dispatch
    assert evidence.verify_chains(run.pk, "default") is None


def test_a_deferred_success_survives_the_rollback_of_the_transactional_step_after_it():
    """The block that carried it rolled back (the action answered "failed"): the PURE
    step's success is still journaled, before the step's failure, and no row stays."""
    run = start_workflow_run("hot.pure_then_refused", {"n": 0})
    assert Execution(run.pk, claim_for(run)).execute() == "succeeded"
    assert [(e.seq, e.state) for e in journal(run)] == [(0, "succeeded"), (1, "failed")]
    assert journal(run)[1].error_code == "REFUSED"
    assert fresh(run).output == {"n": 1, "refused": True}
    assert not DomainRow.objects.exists()
    assert evidence.verify_chains(run.pk, "default") is None


def test_a_transactional_step_that_loses_the_run_commits_neither_its_row_nor_the_success():
    """The fence at the journal write fails: the deferred success, written in the same
    block, rolls back with the row. Nothing of the claim commits; a replay runs both."""
    committed_hooks.clear()
    run = start_workflow_run("hot.pure_then_lost", {"n": 0})
    generation = claim_for(run)
    assert Execution(run.pk, generation).execute() != "succeeded"
    assert connection.connection.info.transaction_status == 0
    assert not DomainRow.objects.exists()
    assert journal(run) == []
    assert committed_hooks == []


def test_a_transactional_step_whose_journal_write_finds_the_run_not_ours_commits_nothing(
    prepares,
):
    """The journal entry goes with the COMMIT: if its fence fails, the COMMIT must not
    run, or the action's write would commit without its step (a stale write)."""
    committed_hooks.clear()
    run = start_workflow_run("hot.transactional_then_lost", {})
    generation = claim_for(run)
    assert Execution(run.pk, generation).execute() != "succeeded"
    assert connection.connection.info.transaction_status == 0
    assert not DomainRow.objects.exists()
    assert journal(run) == []
    assert fresh(run).generation == generation
    assert committed_hooks == []


def test_a_transactional_step_inside_an_open_transaction_leaves_the_commit_to_it():
    """Run from inside a caller's transaction (a test's, say), the step's block is a
    savepoint: the kernel must not COMMIT the caller's transaction from inside it."""
    from django.db import transaction

    committed_hooks.clear()
    run = start_workflow_run("hot.two_transactional", {"n": 0})
    generation = claim_for(run)
    with transaction.atomic():
        DomainRow.objects.create(key="the caller's")
        assert Execution(run.pk, generation).execute() == "succeeded"
        assert [e.seq for e in journal(run)] == [0, 1]
        transaction.set_rollback(True)
    assert not DomainRow.objects.exists()
    assert journal(run) == []
    assert committed_hooks == []


def test_a_run_ends_as_written_after_a_wake_and_as_read_after_someone_else_wrote(monkeypatch):
    """A resumed run's entries come from its claim, verified, with their row versions:
    its end too checks the chains as written. A ledger entry this execution did not
    append (a note, as a fenced-out worker's late result) makes that check fail: the
    end then goes the way that reads and verifies the chains, and succeeds."""
    ends: list[tuple[str, bool]] = []

    def spying(name: str):
        original = getattr(RunEnding, name)

        def spy(self, *args):
            result = original(self, *args)
            ends.append((name, result))
            return result

        return spy

    for name in ("end_as_written", "end_as_read"):
        monkeypatch.setattr(RunEnding, name, spying(name))
    resumed = start_workflow_run("kernel.tamper", {"key": "later"})
    run_to_end()
    assert fresh(resumed).status == "waiting"
    assert journal(resumed)  # the step before the wait, read at the next claim
    DomainRow.objects.create(key="later")
    wake_workflow_runs_waiting_on(app_id="tests", kind="signal", key="later")
    run_to_end()
    assert fresh(resumed).status == "succeeded"
    assert ends == [("end_as_written", True)]
    ends.clear()
    noted = start_workflow_run("hot.two_noted", {"n": 0})
    assert Execution(noted.pk, claim_for(noted)).execute() == "succeeded"
    # Refused, having written nothing; then the read, whose batched writes the stale
    # ledger head refuses too, and the end one statement at a time.
    assert ends == [("end_as_written", False), ("end_as_read", False)]
    assert fresh(noted).output == {"n": 2}
    assert evidence.verify_chains(resumed.pk, "default") is None
    assert evidence.verify_chains(noted.pk, "default") is None


def test_a_batched_dispatch_whose_commit_answer_is_lost_is_closed_as_never_sent(
    monkeypatch, prepares
):
    """The server commits the one-round-trip dispatch, the client never hears so: the
    invocation is closed as never sent (run() was not called), and the step dispatches
    anew. Fault injection: the batch really commits, then the client sees an error."""
    from django.db import OperationalError

    from k2b_workflows.kernel import db
    from k2b_workflows.testing import run_until_idle

    sent = db._in_one_round_trip
    cut: list[int] = []

    def commit_then_lose_the_answer(using, statements):
        results = sent(using, statements)
        dispatch = any("dispatched" in params for _, params in statements)
        if dispatch and statements[-1][0] == "COMMIT" and not cut:
            cut.append(1)
            raise OperationalError("server closed the connection unexpectedly")
        return results

    monkeypatch.setattr(db, "_in_one_round_trip", commit_then_lose_the_answer)
    run = start_workflow_run("hot.three_external", {"n": 0})
    run_until_idle(app_ids=["hot"])
    assert cut == [1]
    done = fresh(run)
    assert (done.status, done.output) == ("succeeded", {"n": 3}), done.error_message
    assert_closed_as_never_sent(run)
    assert evidence.verify_chains(run.pk, "default") is None


def test_batched_writes_after_someone_else_wrote_to_the_ledger_go_one_at_a_time(prepares):
    """A note in the ledger (a late result) moves its end past what the executor knows:
    the batched dispatch and the batched end must write nothing and the writes go one
    statement at a time, chained after the note. Lenient statements in the batch would
    commit the ones after the refused append: a success without its ledger entry."""
    run = start_workflow_run("hot.two_noted", {"n": 0})
    generation = claim_for(run)
    assert Execution(run.pk, generation).execute() == "succeeded"
    assert fresh(run).output == {"n": 2}
    assert [(seq, kind) for seq, kind, _ in _ledger(run)] == [
        (seq, kind) for seq in range(2) for kind in ("dispatched", "late_result", "succeeded")
    ]
    assert [e.seq for e in journal(run)] == [0, 1]
    assert evidence.verify_chains(run.pk, "default") is None
    assert connection.connection.info.transaction_status == 0


def test_a_failed_batched_read_leaves_the_connection_usable(prepares):
    """ "BEGIN; read" that fails leaves an aborted transaction Django does not know of:
    it must be rolled back there, or the connection's next statement fails."""
    from django.db import DataError

    from k2b_workflows.kernel import db

    with pytest.raises(DataError):
        db.begin_and_fetch("default", "SELECT 1 / %s", [0])
    assert connection.connection.info.transaction_status == 0  # idle
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        assert cursor.fetchone() == (1,)


def test_a_failed_batched_write_commits_nothing_and_leaves_the_connection_usable(prepares):
    """The statement before COMMIT fails: the COMMIT must not run, the transaction's
    earlier write is rolled back, and the connection is idle again."""
    from django.db import DataError

    from k2b_workflows.kernel import db

    run = start_workflow_run("hot.three_pure", {"n": 0})
    rows = db.begin_and_fetch(
        "default",
        "UPDATE k2b_run SET consecutive_failures = 7 WHERE id = %s RETURNING id",
        [run.pk],
    )
    assert rows == [(run.pk,)]
    with pytest.raises(DataError):
        db.commit_with("default", "SELECT 1 / %s", [0])
    assert connection.connection.info.transaction_status == 0
    assert fresh(run).consecutive_failures == 0


def test_a_batched_transaction_that_decides_not_to_write_writes_nothing(prepares):
    from k2b_workflows.kernel import db

    run = start_workflow_run("hot.three_pure", {"n": 0})
    update = ("UPDATE k2b_run SET consecutive_failures = 0 WHERE id = %s RETURNING id", [run.pk])
    sql = "SELECT id FROM k2b_run WHERE id = %s"
    assert db.read_then_write("default", sql, [run.pk], lambda rows: None) == (False, [])
    assert connection.connection.info.transaction_status == 0
    written = db.read_then_write("default", sql, [run.pk], lambda rows: [update])
    assert written == (True, [(run.pk,)])
    assert connection.connection.info.transaction_status == 0
