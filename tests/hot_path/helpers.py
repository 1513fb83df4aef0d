"""Helpers of the hot-path tests: count round trips and table statistics (runs are claimed
by ``tests.support.kernel.claim_for``, as the kernel tests claim them)."""

from __future__ import annotations

import contextlib
import tempfile

from django.db import connection
from psycopg import pq

from k2b_workflows import start_workflow_run
from k2b_workflows.kernel.execute import Execution
from k2b_workflows.kernel.load import preload
from k2b_workflows.models import JournalEntry, WorkflowRun
from tests.support.kernel import claim_for

TIMEOUT = 90


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
        assert Execution(first.pk, claim_for(first)).execute() == "succeeded"
    run = start_workflow_run(name, input)
    generation = claim_for(run)
    loaded = preload("default", [run.pk])[run.pk]
    with _round_trips() as counted:
        assert Execution(run.pk, generation, preloaded=loaded).execute() == "succeeded"
    return run, counted[0]


def _prepared_statements() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


def _run_table_counts(*counts: str) -> tuple[int, ...]:
    """This backend's ``pg_stat_get_xact_<count>`` for ``k2b_run``: counts not yet
    flushed to the shared statistics, which happens between transactions only, so
    a difference inside one transaction is exact."""
    columns = ", ".join(f"pg_stat_get_xact_{c}('k2b_run'::regclass)" for c in counts)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {columns}")
        return cursor.fetchone()
