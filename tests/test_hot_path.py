"""The worker's hot path: batched claims with a prefetch, the fenced one-statement journal
write, a run's end merged with its last step, the raw preload, and the benchmark smoke run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest
from django.db import connection, connections
from psycopg import pq

from k2b_workflows import (
    Action,
    Effect,
    failed,
    start_workflow_run,
    succeeded,
    wake_workflow_runs_waiting_on,
    workflow,
)
from k2b_workflows.exceptions import LeaseLost, RunCanceled, StepFailed
from k2b_workflows.kernel import claim, evidence
from k2b_workflows.kernel.ending import RunEnding
from k2b_workflows.kernel.execute import Execution
from k2b_workflows.kernel.load import preload
from k2b_workflows.models import JournalEntry, LedgerEntry, WorkflowRun
from tests.conftest import ROOT, direct_connection_only
from tests.kernel_helpers import assert_closed_as_never_sent, fresh, journal, run_to_end
from tests.models import DomainRow, ProviderCall

pytestmark = pytest.mark.django_db(transaction=True)


class AddOne(Action):
    name = "hot.add_one"
    effect = Effect.PURE

    def run(self, ctx, input):
        return succeeded({"n": input["n"] + 1})


class Dispatch(Action):
    name = "hot.dispatch"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        return succeeded({"n": input["n"] + 1, "key": ctx.invocation_key})

    def reconcile(self, ctx, input):
        return succeeded({"n": input["n"] + 1, "key": ctx.invocation_key})


class DispatchAfterStep(Action):
    """EXTERNAL whose provider notes how many of the run's steps were journaled when called."""

    name = "hot.dispatch_after_step"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        before = JournalEntry.objects.filter(run_id=ctx.run_id, seq__lt=ctx.step).count()
        return succeeded({"journaled_before_call": before})

    reconcile = run


@workflow("hot.pure_then_external", app_id="hot")
def pure_then_external(run, input):
    run.step(AddOne, {"n": 0})
    return run.step(DispatchAfterStep, {})


def _three_steps(action: type[Action]):
    """A workflow body: three steps of ``action``, each adding one to ``n``."""

    def body(run, input):
        n = input["n"]
        for _ in range(3):
            n = run.step(action, {"n": n})["n"]
        return {"n": n}

    return body


three_pure = workflow("hot.three_pure", app_id="hot")(_three_steps(AddOne))


@workflow("hot.external_then_pure", app_id="hot")
def external_then_pure(run, input):
    n = run.step(Dispatch, {"n": input["n"]})["n"]
    return run.step(AddOne, {"n": n})


class DispatchThenNote(Action):
    """EXTERNAL whose call also leaves a note in the run's ledger, as a fenced-out
    worker's late result would: the executor's idea of the ledger's end goes stale."""

    name = "hot.dispatch_then_note"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        evidence.append_ledger(
            "default", run_id=ctx.run_id, seq=ctx.step, kind="late_result", message="a note"
        )
        return succeeded({"n": input["n"] + 1})

    reconcile = run


three_external = workflow("hot.three_external", app_id="hot")(_three_steps(Dispatch))


@workflow("hot.two_noted", app_id="hot")
def two_noted(run, input):
    n = run.step(DispatchThenNote, {"n": input["n"]})["n"]
    return run.step(DispatchThenNote, {"n": n})


#: ``on_commit`` hooks of TRANSACTIONAL steps, in the order they ran.
committed_hooks: list[str] = []


class WriteRow(Action):
    """TRANSACTIONAL: one domain row in ``ctx.tx``, and a hook for once it commits."""

    name = "hot.write_row"
    effect = Effect.TRANSACTIONAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        from django.db import transaction

        DomainRow.objects.using(ctx.tx.using).create(key=ctx.effect_key)
        transaction.on_commit(lambda: committed_hooks.append(ctx.effect_key), using=ctx.tx.using)
        return succeeded({"n": input["n"] + 1})


class WriteRowThenLose(WriteRow):
    """Writes its row, then, in the same transaction, moves the run to another
    generation, as a takeover would were the fence not holding the row's lock."""

    name = "hot.write_row_then_lose"

    def run(self, ctx, input):
        result = super().run(ctx, input)
        with connections[ctx.tx.using].cursor() as cursor:
            cursor.execute(
                "UPDATE k2b_run SET generation = generation + 1 WHERE id = %s", [ctx.run_id]
            )
        return result


@workflow("hot.transactional_then_lost", app_id="hot")
def transactional_then_lost(run, input):
    return run.step(WriteRowThenLose, {"n": 0})


@workflow("hot.two_transactional", app_id="hot")
def two_transactional(run, input):
    n = run.step(WriteRow, {"n": input["n"]})["n"]
    return run.step(WriteRow, {"n": n})


@workflow("hot.pure_then_transactional", app_id="hot")
def pure_then_transactional(run, input):
    n = run.step(AddOne, {"n": input["n"]})["n"]
    return run.step(WriteRow, {"n": n})


class WriteRowThenRefuse(WriteRow):
    """Writes its row, then answers that the effect failed: the block rolls back."""

    name = "hot.write_row_then_refuse"

    def run(self, ctx, input):
        super().run(ctx, input)
        return failed("refused after writing", code="REFUSED")


@workflow("hot.pure_then_refused", app_id="hot")
def pure_then_refused(run, input):
    n = run.step(AddOne, {"n": input["n"]})["n"]
    try:
        run.step(WriteRowThenRefuse, {"n": n})
    except StepFailed:
        return {"n": n, "refused": True}
    raise AssertionError("the step should have failed")


@workflow("hot.pure_then_lost", app_id="hot")
def pure_then_lost(run, input):
    n = run.step(AddOne, {"n": input["n"]})["n"]
    return run.step(WriteRowThenLose, {"n": n})


TIMEOUT = 90


def _claim(run: WorkflowRun) -> int:
    claimed = claim.claim_runs(
        "default",
        worker_id="test",
        workflows=[(run.workflow_name, run.workflow_version)],
        app_ids=None,
        limit=1,
    )
    assert claimed and claimed[0][0] == run.pk
    return claimed[0][1]


def _entry(run: WorkflowRun, generation: int) -> JournalEntry:
    from django.utils import timezone

    return JournalEntry(
        run_id=run.pk,
        seq=0,
        action_name="test.add",
        effect="pure",
        state=JournalEntry.State.SUCCEEDED,
        output={"n": 1},
        input_hash="0" * 64,
        generation=generation,
        started_at=timezone.now(),
        created_at=timezone.now(),
    )


def test_the_one_statement_journal_write_refuses_a_stale_generation():
    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    generation = _claim(run)
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


def test_the_one_statement_journal_write_refuses_a_canceled_run():
    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    generation = _claim(run)
    WorkflowRun.objects.filter(pk=run.pk).update(status="canceled")
    with pytest.raises(RunCanceled):
        evidence.append_journal_fenced(
            _entry(run, generation), evidence.GENESIS, "default", lease_ms=30_000
        )
    assert journal(run) == []


def test_a_run_ends_in_the_same_commit_as_its_last_step():
    """Three PURE steps and the end: three write transactions, the last holding the end."""
    run = start_workflow_run("hot.three_pure", {"n": 0})
    generation = _claim(run)
    assert Execution(run.pk, generation).execute() == "succeeded"
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT xmin::text FROM k2b_journal WHERE run_id = %s ORDER BY seq", [run.pk]
        )
        steps = [row[0] for row in cursor.fetchall()]
        cursor.execute("SELECT xmin::text FROM k2b_run WHERE id = %s", [run.pk])
        (end,) = cursor.fetchone()
    assert len(set(steps)) == 3  # one commit per step ...
    assert steps[-1] == end  # ... and the run's end is in the last one
    assert fresh(run).status == "succeeded"
    assert fresh(run).output == {"n": 3}
    assert evidence.verify_chains(run.pk, "default") is None


def test_an_external_dispatch_commits_the_previous_steps_success_before_the_call():
    """The deferred success of step 0 rides in step 1's dispatch: one commit, not two,
    and committed before the provider is called."""
    run = start_workflow_run("hot.pure_then_external", {})
    generation = _claim(run)
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


@pytest.fixture(params=["prepared", "unprepared"])
def prepares(request):
    """The connection with psycopg preparing statements from their first run, or never
    (``prepare_threshold`` None, Django's default): the kernel's batched transactions
    are pipelines of prepared statements in the first case, multi-statement strings
    in the second. A new connection: nothing is prepared on it yet."""
    if request.param == "prepared" and os.environ.get("K2B_TEST_POOL_MODE") == "transaction":
        pytest.skip(
            "through a transaction-pooling PgBouncer before 1.21 nothing may be prepared "
            "(docs/operations.md#pgbouncer): prepare_threshold is None"
        )
    connection.close()
    connection.ensure_connection()
    before = connection.connection.prepare_threshold
    connection.connection.prepare_threshold = 0 if request.param == "prepared" else None
    yield request.param == "prepared"
    connection.connection.prepare_threshold = before


@contextlib.contextmanager
def _round_trips():
    """Counts the round trips of Django's connection, from libpq's trace: one per
    simple-protocol Query, one per Sync of the extended protocol (a pipeline's too)."""
    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    counted: list[int] = []
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            yield counted
        finally:
            pgconn.untrace()
            trace.seek(0)
            # One message a line, but a query's text may span lines.
            messages = ("\n" + trace.read()).split("\nF\t")[1:]
            kinds = [m.split("\t")[1].split()[0] for m in messages]
            counted.append(kinds.count("Query") + kinds.count("Sync"))


def _ledger(run: WorkflowRun) -> list[tuple[int, str, str]]:
    """(seq, kind, xmin) of the run's ledger in chain order; xmin tells the commit."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT seq, kind, xmin::text FROM k2b_ledger WHERE run_id = %s ORDER BY id", [run.pk]
        )
        return cursor.fetchall()


def _counted_run(name: str, input: dict, *, warm: bool = False) -> tuple[WorkflowRun, int]:
    """Start, claim and execute a run of ``name`` as a worker would (the claim's
    preload handed over); returns it and the round trips of its execution.
    ``warm``: run one first, so that its statements are prepared on the connection
    (outside a pipeline, preparing is a round trip of its own)."""
    if warm:
        first = start_workflow_run(name, input)
        assert Execution(first.pk, _claim(first)).execute() == "succeeded"
    run = start_workflow_run(name, input)
    generation = _claim(run)
    loaded = preload("default", [run.pk])[run.pk]
    with _round_trips() as counted:
        assert Execution(run.pk, generation, preloaded=loaded).execute() == "succeeded"
    return run, counted[0]


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


def test_a_deferred_success_survives_the_rollback_of_the_transactional_step_after_it():
    """The block that carried it rolled back (the action answered "failed"): the PURE
    step's success is still journaled, before the step's failure, and no row stays."""
    run = start_workflow_run("hot.pure_then_refused", {"n": 0})
    assert Execution(run.pk, _claim(run)).execute() == "succeeded"
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
    generation = _claim(run)
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
    generation = _claim(run)
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
    generation = _claim(run)
    with transaction.atomic():
        DomainRow.objects.create(key="the caller's")
        assert Execution(run.pk, generation).execute() == "succeeded"
        assert [e.seq for e in journal(run)] == [0, 1]
        transaction.set_rollback(True)
    assert not DomainRow.objects.exists()
    assert journal(run) == []
    assert committed_hooks == []


@pytest.fixture
def server_side_binding():
    """Django's connection with ``OPTIONS["server_side_binding"]``: its cursors bind
    parameters on the server (``ServerBindingCursor``). A new connection, as ``prepares``."""
    options = connection.settings_dict.setdefault("OPTIONS", {})
    before = options.get("server_side_binding")
    options["server_side_binding"] = True
    connection.close()
    yield
    connection.close()
    if before is None:
        del options["server_side_binding"]
    else:
        options["server_side_binding"] = before


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
    and COMMIT. A three-step PURE run: two steps' entries, then the end."""
    run, counted = _counted_run("hot.three_pure", {"n": 0})
    assert counted == 3
    assert fresh(run).output == {"n": 3}
    assert [e.seq for e in journal(run)] == [0, 1, 2]
    assert evidence.verify_chains(run.pk, "default") is None


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
    assert Execution(noted.pk, _claim(noted)).execute() == "succeeded"
    # Refused, having written nothing; then the read, whose batched writes the stale
    # ledger head refuses too, and the end one statement at a time.
    assert ends == [("end_as_written", False), ("end_as_read", False)]
    assert fresh(noted).output == {"n": 2}
    assert evidence.verify_chains(resumed.pk, "default") is None
    assert evidence.verify_chains(noted.pk, "default") is None


def test_a_claim_and_its_preload_are_one_transaction_in_two_round_trips(prepares):
    """ "BEGIN; claim", then "preload; COMMIT": where Django's transaction took four
    (BEGIN, claim, preload, COMMIT). A claim that finds nothing rolls back."""
    from k2b_workflows.worker import Worker

    runs = [start_workflow_run("hot.three_pure", {"n": n}) for n in range(3)]
    worker = Worker(app_ids=["hot"], concurrency=2, listen=False)
    with _round_trips() as counted:
        claimed, loaded, tasks = worker.claim(3, task_slots=0)
    assert counted == [2]
    assert sorted(str(run_id) for run_id, _ in claimed) == sorted(str(r.pk) for r in runs)
    assert set(loaded) == {r.pk for r in runs} and tasks == []
    assert {fresh(r).status for r in runs} == {"running"}
    assert connection.connection.info.transaction_status == 0
    with _round_trips() as counted:
        assert worker.claim(3, task_slots=0) == ([], {}, [])
    assert counted == [2]
    assert connection.connection.info.transaction_status == 0


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
    generation = _claim(run)
    assert Execution(run.pk, generation).execute() == "succeeded"
    assert fresh(run).output == {"n": 2}
    assert [(seq, kind) for seq, kind, _ in _ledger(run)] == [
        (seq, kind) for seq in range(2) for kind in ("dispatched", "late_result", "succeeded")
    ]
    assert [e.seq for e in journal(run)] == [0, 1]
    assert evidence.verify_chains(run.pk, "default") is None
    assert connection.connection.info.transaction_status == 0


def _prepared_statements() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


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


@direct_connection_only
def test_the_hot_statements_are_prepared_only_when_the_connection_prepares(prepares):
    """With ``prepare_threshold`` set, the step's journal write, the claim, the preload
    and the run's end are prepared on the server; with it None (a transaction-pooling
    PgBouncer before 1.21 needs that), nothing the kernel runs is prepared."""
    run = start_workflow_run("hot.three_pure", {"n": 0})
    assert Execution(run.pk, _claim(run)).execute() == "succeeded"
    assert fresh(run).output == {"n": 3}
    statements = _prepared_statements()
    if not prepares:
        assert statements == []
        return
    assert any("INSERT INTO k2b_journal" in s and "lease_expires_at" in s for s in statements)
    assert any("INSERT INTO k2b_journal" in s and "status = 'succeeded'" in s for s in statements)
    assert any("json_agg(j ORDER BY j.seq)" in s for s in statements)
    assert any("FOR UPDATE SKIP LOCKED" in s for s in statements)


def _run_table_counts(*counts: str) -> tuple[int, ...]:
    """This backend's ``pg_stat_get_xact_<count>`` for ``k2b_run``: counts not yet
    flushed to the shared statistics, which happens between transactions only, so
    a difference inside one transaction is exact."""
    columns = ", ".join(f"pg_stat_get_xact_{c}('k2b_run'::regclass)" for c in counts)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {columns}")
        return cursor.fetchone()


def test_a_steps_fence_and_journal_write_update_the_run_row_in_place():
    """Neither changes an indexed column of ``k2b_run`` (migration 0010), so both are
    HOT updates: no new entry in any of the table's nine indexes, a step at a time."""
    from django.db import transaction

    from k2b_workflows.kernel import db

    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    generation = _claim(run)
    counts = ("tuples_updated", "tuples_hot_updated")
    with transaction.atomic():
        (updated, hot) = _run_table_counts(*counts)
        db.fence("default", run.pk, generation, 30_000, 0)
        evidence.append_journal_fenced(
            _entry(run, generation), evidence.GENESIS, "default", lease_ms=30_000
        )
        assert _run_table_counts(*counts) == (updated + 2, hot + 2)


def test_a_runs_children_are_found_through_the_child_index_alone():
    """Every index of ``k2b_run`` takes an entry at each enqueue and status change:
    lookups by parent go through ``k2b_run_child_once`` (partial, children only),
    and no index holds every run's ``parent_id`` (migration 0013)."""
    from django.db import transaction

    parent = start_workflow_run("test.pure", {"a": 1, "b": 1})
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT indexname FROM pg_indexes WHERE tablename = 'k2b_run'
                AND indexdef LIKE '%%(parent_id)'"""
        )
        assert cursor.fetchall() == []
        with transaction.atomic():
            cursor.execute("SET LOCAL enable_seqscan = off")
            cursor.execute("EXPLAIN SELECT id FROM k2b_run WHERE parent_id = %s", [parent.pk])
            plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "k2b_run_child_once" in plan, plan


def test_a_claim_reads_a_few_rows_of_a_large_backlog_postgresql_has_not_analyzed(prepares):
    """Right after a bulk enqueue, before any ANALYZE, PostgreSQL expects a handful of
    queued runs: without the claim's plan setting it read all of them into a bitmap and
    sorted them at every claim. The claim must walk the index and stop."""
    from django.db import transaction

    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    with transaction.atomic(), connection.cursor() as cursor:
        # Copies of one queued run (never executed), without 20,000 notifications.
        cursor.execute("SET LOCAL session_replication_role = replica")
        cursor.execute(
            """INSERT INTO k2b_run
               SELECT copy.*
                 FROM k2b_run r, generate_series(1, 20000) n,
                      jsonb_populate_record(NULL::k2b_run,
                          to_jsonb(r) || jsonb_build_object('id', gen_random_uuid(), 'n', n)) copy
                WHERE r.id = %s""",
            [run.pk],
        )
    with transaction.atomic():
        (before,) = _run_table_counts("tuples_fetched")
        claimed = claim.claim_runs(
            "default", worker_id="test", workflows=[("test.pure", 1)], app_ids=None, limit=4
        )
        assert len(claimed) == 4
        assert _run_table_counts("tuples_fetched")[0] - before < 100
        transaction.set_rollback(True)


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


def test_a_start_is_one_transaction_and_returns_the_run_as_stored():
    """The run and its budget account in one statement, in autocommit its own
    transaction: one round trip, where BEGIN, two inserts, COMMIT and a read back
    took five. The instance returned is the row, field by field."""
    with _round_trips() as counted:
        run = start_workflow_run(
            "hot.three_pure", {"n": 1.5, "deep": [1, {"b": None, "a": "x"}]}, principal={"u": 7}
        )
    assert counted == [1]
    stored = fresh(run)
    for field in WorkflowRun._meta.concrete_fields:
        assert getattr(run, field.attname) == getattr(stored, field.attname), field
    assert not run._state.adding and run._state.db == "default"


@pytest.mark.parametrize("binding", ["client", "server"])
def test_a_start_stores_the_budget_and_the_parent_whatever_djangos_cursor_class(request, binding):
    """The account's values go in a SELECT (inserted only with the run): their types
    come from the columns whether Django binds on the client or on the server."""
    from k2b_workflows.models import BudgetAccount

    if binding == "server":
        request.getfixturevalue("server_side_binding")
    root = start_workflow_run("test.charge", {"amount": 5})
    account = BudgetAccount.objects.get(root_id=root.pk)
    assert account.effect_budget == {"charges": 2} and account.spent == {}
    assert account.max_ai_calls is None and account.ai_calls == 0
    limited = start_workflow_run("fanout.ai", {})
    assert BudgetAccount.objects.get(root_id=limited.pk).max_ai_calls == 1
    child = start_workflow_run("hot.three_pure", {"n": 0}, parent=root.pk)
    assert fresh(child).parent_id == root.pk and fresh(child).root_id == root.pk
    assert not BudgetAccount.objects.filter(root_id=child.pk).exists()


def test_a_start_that_fails_inside_an_atomic_block_marks_it_for_rollback():
    """As Django's ``create()``: the block cannot go on as if nothing happened, and the
    run and its account are both gone with it."""
    from django.db import DatabaseError, transaction

    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION k2b_test_refuse() RETURNS trigger LANGUAGE plpgsql"
            " AS $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$"
        )
        cursor.execute(
            "CREATE TRIGGER k2b_test_refuse BEFORE INSERT ON k2b_budget_account"
            " FOR EACH ROW EXECUTE FUNCTION k2b_test_refuse()"
        )
    try:
        with transaction.atomic():
            with pytest.raises(DatabaseError, match="refused by the test"):
                start_workflow_run("hot.three_pure", {"n": 0})
            assert connection.needs_rollback
        assert not WorkflowRun.objects.exists()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER k2b_test_refuse ON k2b_budget_account")
            cursor.execute("DROP FUNCTION k2b_test_refuse()")


def test_the_raw_preload_reads_what_the_orm_reads():
    run = start_workflow_run("hot.external_then_pure", {"n": 0})
    from tests.kernel_helpers import run_to_end

    run_to_end()
    loaded = preload("default", [run.pk])[run.pk]
    assert loaded.run == fresh(run)
    for field in WorkflowRun._meta.concrete_fields:
        assert getattr(loaded.run, field.attname) == getattr(fresh(run), field.attname), field
    orm_journal = journal(run)
    orm_ledger = list(LedgerEntry.objects.filter(run=run, seq__isnull=False).order_by("id"))
    assert orm_journal and orm_ledger
    assert len(loaded.journal) == len(orm_journal) and len(loaded.ledger) == len(orm_ledger)
    pairs = [*zip(loaded.journal, orm_journal, strict=True)]
    pairs += zip(loaded.ledger, orm_ledger, strict=True)
    for ours, theirs in pairs:
        for field in type(theirs)._meta.concrete_fields:
            assert getattr(ours, field.attname) == getattr(theirs, field.attname), field
    assert len(loaded.journal) == len(orm_journal) and len(loaded.ledger) == len(orm_ledger)


def test_a_worker_is_ready_before_its_first_claim(monkeypatch):
    """The metrics exist and every pool thread has its connection before a run needs
    them: the first run of each thread used to pay for both (prometheus_client's
    import, with the import lock and the GIL held, and a new connection)."""
    import threading

    from django.db.backends.signals import connection_created

    from k2b_workflows import metrics
    from k2b_workflows.worker import Worker

    events: list[str] = []
    monkeypatch.setattr(metrics, "prepare", lambda: events.append("metrics"))

    def created(sender, connection, **kwargs):
        events.append(f"connection {threading.current_thread().name}")

    worker = Worker(app_ids=["hot"], concurrency=3, listen=False, burst=True)
    claim = worker.claim

    def claiming(limit: int, **kwargs):
        events.append("claim")
        return claim(limit, **kwargs)

    worker.claim = claiming  # type: ignore[method-assign]
    connection_created.connect(created)
    try:
        worker.run()  # nothing to run: no run ever opens a thread's connection
    finally:
        connection_created.disconnect(created)
    assert "claim" in events and events.index("metrics") < events.index("claim"), events
    pool = {e for e in events if e.startswith("connection k2b-worker")}
    assert len(pool) == worker.concurrency, events


def test_metrics_prepare_creates_the_metrics():
    from k2b_workflows import metrics

    if not metrics.AVAILABLE:
        pytest.skip("prometheus_client is not installed")
    metrics.prepare()
    assert {"steps", "step_seconds", "transitions"} <= set(metrics._metrics)


def test_sigterm_hands_back_prefetched_runs_that_no_thread_started(start_worker, wait):
    # One thread, busy for seconds: the other runs wait in the prefetch queue meanwhile.
    slow = start_workflow_run("kernel.slow", {"seconds": 8})
    queued = [start_workflow_run("test.pure", {"a": i, "b": 1}) for i in range(3)]
    worker = start_worker("--concurrency", "1")
    wait(
        lambda: ProviderCall.objects.filter(action="kernel.slow").exists(),
        timeout=TIMEOUT,
        message=lambda: f"the slow step to start:\n{worker.report()}",
    )
    wait(
        lambda: all(fresh(r).status == "running" for r in queued),
        timeout=TIMEOUT,
        message="the prefetch to claim the other runs",
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()

    for run in queued:
        run = fresh(run)
        assert (run.status, run.claimed_by, run.lease_expires_at) == ("queued", "", None)
        assert run.consecutive_failures == 0  # handed back, not a crash
    assert fresh(slow).status in {"queued", "succeeded"}


@pytest.mark.slow
@direct_connection_only
def test_bench_quick_prints_one_json_line_with_the_numbers():
    """A smoke run at the smallest sizes: no timing asserted, only that it runs and reports."""
    url = os.environ.get("DATABASE_URL")
    if not url:
        pytest.skip("DATABASE_URL is not set")
    from bench.run import with_db

    # Databases of its own, named after the test database: never a developer's bench.
    url = with_db(url, connection.settings_dict["NAME"])
    proc = subprocess.run(
        [
            *(sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--runs", "3"),
            *("--rounds", "2", "--wakes", "2", "--fanout", "3", "--processes", "1"),
        ],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in (
        "steps_per_s",
        "workflows_per_s",
        "commits_per_step",
        "pgbench_tps",
        "ratio_to_pgbench",
        "wake_p50_ms",
        "wake_p99_ms",
        "effects",
        "fanout",
        "processes",
    ):
        assert key in result, key
    assert set(result["effects"]) == {"PURE", "TRANSACTIONAL", "IDEMPOTENT", "EXTERNAL", "MIX"}
    for measured in result["effects"].values():
        assert len(measured["rounds"]) == 2 and measured["vs_pure"] > 0
    assert result["effects"]["PURE"]["vs_pure"] == 1
    assert result["fanout"]["children"] == 3
