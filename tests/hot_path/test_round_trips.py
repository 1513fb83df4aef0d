"""Round trips per step, counted from libpq's trace, with and without prepared
statements: which statements travel together, and which are prepared."""

from __future__ import annotations

import pytest
from django.db import connection

from k2b_workflows import start_workflow_run
from k2b_workflows.kernel import evidence
from k2b_workflows.kernel.execute import Execution
from tests.hot_path.helpers import _counted_run, _ledger, _prepared_statements
from tests.hot_path.workflows import committed_hooks
from tests.support.kernel import claim_for, fresh, journal
from tests.support.processes import direct_connection_only

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_external_dispatch_is_one_round_trip_carrying_the_previous_steps_success(prepares):
    """Fence, the previous EXTERNAL step's "succeeded" and journal entry, and this step's
    "dispatched", with BEGIN and COMMIT: one round trip. One at a time they were six."""
    run, counted = _counted_run("hot.three_external", {"n": 0})
    # Three dispatches, and the end, which verifies the chains as it writes them.
    assert counted == 4
    assert fresh(run).output == {"n": 3}
    ledger = _ledger(run)
    assert [(seq, kind) for seq, kind, _ in ledger] == [
        (seq, kind) for seq in range(3) for kind in ("dispatched", "succeeded")
    ]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT xmin::text FROM k2b_journal WHERE run_id = %s ORDER BY seq", [run.pk]
        )
        journaled = [row[0] for row in cursor.fetchall()]
    # Step n's success commits with step n + 1's dispatch, the last one with the end.
    assert journaled[:2] == [ledger[2][2], ledger[4][2]] == [ledger[1][2], ledger[3][2]]
    assert journaled[2] == ledger[5][2]
    assert evidence.verify_chains(run.pk, "default") is None


def test_a_transactional_steps_journal_entry_goes_with_its_commit(prepares):
    """BEGIN, the action's write, then the fence with the journal entry and COMMIT in
    one round trip; the step's ``on_commit`` hooks still run, once, after its commit.
    No fence of its own before ``run()``: the journal statement's is the step's."""
    committed_hooks.clear()
    run, counted = _counted_run("hot.two_transactional", {"n": 0}, warm=True)
    # Two steps of three round trips, prepared or not, and the end's one.
    assert counted == 7
    assert committed_hooks[-2:] == [f"{run.pk}:0", f"{run.pk}:1"]
    assert len(committed_hooks) == 4  # the warm-up run's two, then these
    assert fresh(run).output == {"n": 2}
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT j.xmin::text = d.xmin::text FROM k2b_journal j
                 JOIN tests_domainrow d ON d.key = j.run_id || ':' || j.seq
                WHERE j.run_id = %s ORDER BY j.seq""",
            [run.pk],
        )
        assert cursor.fetchall() == [(True,), (True,)]  # each entry with its row
    assert evidence.verify_chains(run.pk, "default") is None


def test_a_transactional_step_commits_the_previous_steps_deferred_success(prepares):
    """A PURE step's success rides on the next transactional step's block: its fenced
    append is the fence taken before ``run()``, and both entries commit with the
    action's row. One transaction and one round trip fewer than flushing it first."""
    run, counted = _counted_run("hot.pure_then_transactional", {"n": 0}, warm=True)
    # BEGIN with the fenced append (alone where not prepared), the action's write,
    # the journal entry with COMMIT; the end's one.
    assert counted == (4 if prepares else 5)
    assert fresh(run).output == {"n": 2}
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT j.seq, j.xmin::text = d.xmin::text FROM k2b_journal j, tests_domainrow d
                WHERE j.run_id = %s AND d.key = j.run_id || ':1' ORDER BY j.seq""",
            [run.pk],
        )
        assert cursor.fetchall() == [(0, True), (1, True)]  # one commit, with the row
    assert evidence.verify_chains(run.pk, "default") is None


def test_batched_writes_do_not_depend_on_djangos_cursor_class(server_side_binding, prepares):
    """The kernel's batches use cursors of their own: with server-side binding for
    Django's cursors, a three-step EXTERNAL run still takes four round trips."""
    from django.db.backends.postgresql.base import ServerBindingCursor

    with connection.cursor() as cursor:
        assert isinstance(cursor.cursor, ServerBindingCursor)
    run, counted = _counted_run("hot.three_external", {"n": 0})
    assert counted == 4
    assert fresh(run).output == {"n": 3}
    assert evidence.verify_chains(run.pk, "default") is None


def test_a_run_that_wrote_every_entry_ends_in_one_round_trip(prepares):
    """A run's end checks its chains as its execution wrote them (each entry's row
    version, the run row's anchors) in the statement that ends it, sent with BEGIN
    and COMMIT. A three-step PURE run: its three entries ride on the end, one round
    trip in all after the claim."""
    run, counted = _counted_run("hot.three_pure", {"n": 0})
    assert counted == 1
    assert fresh(run).output == {"n": 3}
    assert [e.seq for e in journal(run)] == [0, 1, 2]
    assert evidence.verify_chains(run.pk, "default") is None


@direct_connection_only
def test_the_hot_statements_are_prepared_only_when_the_connection_prepares(prepares):
    """With ``prepare_threshold`` set, the step's journal write, the claim, the preload
    and the run's end are prepared on the server; with it None (a transaction-pooling
    PgBouncer before 1.21 needs that), nothing the kernel runs is prepared."""
    run = start_workflow_run("hot.three_pure", {"n": 0})
    assert Execution(run.pk, claim_for(run)).execute() == "succeeded"
    assert fresh(run).output == {"n": 3}
    statements = _prepared_statements()
    if not prepares:
        assert statements == []
        return
    assert any("INSERT INTO k2b_journal" in s and "lease_expires_at" in s for s in statements)
    assert any("INSERT INTO k2b_journal" in s and "status = 'succeeded'" in s for s in statements)
    assert any("json_agg(j ORDER BY j.seq)" in s for s in statements)
    assert any("FOR UPDATE SKIP LOCKED" in s for s in statements)
