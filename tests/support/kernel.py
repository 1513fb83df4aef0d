"""Small helpers shared by the kernel's tests: execute one claim, read state, check invariants."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

from django.db import connection

from k2b_workflows import start_workflow_run
from k2b_workflows.actions import Action, as_action
from k2b_workflows.kernel import attempts, claim, clock, evidence
from k2b_workflows.kernel.context import StepContext
from k2b_workflows.kernel.ending import RunEnding
from k2b_workflows.kernel.execute import Execution
from k2b_workflows.kernel.journal import RunJournal, Step
from k2b_workflows.kernel.load import preload
from k2b_workflows.models import JournalEntry, LedgerEntry, WorkflowRun
from k2b_workflows.store import WORKFLOW_RETRY_EXHAUSTED
from k2b_workflows.testing import run_until_idle

SETTLED = {"succeeded", "failed", "canceled", "needs_attention"}


def run_to_end(timeout: float = 60.0) -> Counter[str]:
    """``run_until_idle`` for the tests app and the kernel tests' second app."""
    return run_until_idle(timeout=timeout)


def execute_once(run: WorkflowRun) -> str:
    """Claim ``run`` (it must be due) and execute that one claim in this thread."""
    claimed = claim.claim_runs(
        "default",
        worker_id="test",
        workflows=[(run.workflow_name, run.workflow_version)],
        app_ids=None,
        limit=1,
    )
    assert claimed, f"run {run.pk} was not claimable"
    run_id, generation = claimed[0]
    assert run_id == run.pk
    return Execution(run_id, generation).execute()


def execute_exactly(run_id: Any) -> str:
    """Claim exactly ``run_id`` (queued and due), whatever else is queued, and execute it here.

    AI tasks and other runs stay queued: tests use it to stop a run between two claims.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            """UPDATE k2b_run SET status = 'running', generation = generation + 1,
                      lease_expires_at = now() + interval '30 seconds'
                WHERE id = %s AND status = 'queued' RETURNING generation""",
            [run_id],
        )
        (generation,) = cursor.fetchone()
    return Execution(run_id, generation).execute()


def make_due(run: WorkflowRun) -> None:
    """Skip a retry's backoff: the tests check the delay, not wait it out."""
    with connection.cursor() as cursor:
        cursor.execute("UPDATE k2b_run SET run_after = now() WHERE id = %s", [run.pk])


def expire_lease(run: WorkflowRun) -> None:
    """What the passing of time does to a crashed worker's lease."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE k2b_run SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
            [run.pk],
        )


def counting_failures(execution: Execution, failures: int) -> None:
    """The claim ``execution`` as if it had loaded its run with ``failures`` consecutive
    failures: the row, the claim's copy, and the sealed reset its completed steps
    carry (``kernel/attempts.py``). Written as the owner: the kernel's own count."""
    WorkflowRun.objects.filter(pk=execution.run_id).update(consecutive_failures=failures)
    execution.run.consecutive_failures = failures
    execution.run.attempts_seq = fresh(execution.run).attempts_seq
    execution.journal.reset = attempts.for_run(execution.run)


def fresh(run: WorkflowRun) -> WorkflowRun:
    return WorkflowRun.objects.get(pk=run.pk)


def ledger_kinds(run: WorkflowRun) -> list[str]:
    return list(LedgerEntry.objects.filter(run=run).order_by("id").values_list("kind", flat=True))


def journal(run: WorkflowRun) -> list[JournalEntry]:
    return list(JournalEntry.objects.filter(run=run).order_by("seq"))


def assert_invariants() -> None:
    """What must hold for every run after any crash: nothing lost, nothing stale, chains intact."""
    for run in WorkflowRun.objects.all():
        assert run.status in SETTLED, f"run {run.pk} ({run.workflow_name}) is lost: {run.status}"
        problem = evidence.verify_chains(run.pk, "default")
        assert problem is None, f"run {run.pk}: {problem}"
        for entry in journal(run):
            assert entry.generation <= run.generation, (
                f"run {run.pk} step {entry.seq} journaled by generation {entry.generation}, "
                f"above the run's {run.generation}"
            )
        seqs = [e.seq for e in journal(run)]
        assert seqs == list(range(len(seqs))), f"run {run.pk}: journal has gaps: {seqs}"


def status_of(run: WorkflowRun) -> tuple[str, str]:
    run = fresh(run)
    return run.status, run.error_code


def describe(run: WorkflowRun) -> dict[str, Any]:
    run = fresh(run)
    return {
        "status": run.status,
        "code": run.error_code,
        "message": run.error_message,
        "generation": run.generation,
        "failures": run.consecutive_failures,
    }


def assert_closed_as_never_sent(run: WorkflowRun) -> None:
    """Step 0's first dispatch committed but its answer was lost: that invocation is
    closed as never sent ("rejected": run() was not called), the second succeeded."""
    ledger = list(LedgerEntry.objects.filter(run=run, seq=0).order_by("id"))
    assert [(e.kind, e.invocation_key.rsplit(":", 1)[1]) for e in ledger] == [
        ("dispatched", "1"),
        ("rejected", "1"),
        ("dispatched", "2"),
        ("succeeded", "2"),
    ]
    assert "run() was not called" in ledger[1].message


def claim_for(run: WorkflowRun, worker_id: str = "test") -> int:
    """Claim ``run`` (it must be due) as a worker would; returns the claim's generation."""
    claimed = claim.claim_runs(
        "default",
        worker_id=worker_id,
        workflows=[(run.workflow_name, run.workflow_version)],
        app_ids=None,
        limit=1,
    )
    assert claimed and claimed[0][0] == run.pk, f"run {run.pk} was not claimable"
    return claimed[0][1]


def claimed_execution(run: WorkflowRun) -> Execution:
    """Claim ``run`` and set its ``Execution`` up as ``Execution.execute`` does once loaded
    (row, journal, ending), without running the workflow: a layer's tests call it."""
    generation = claim_for(run)
    loaded = preload("default", [run.pk])[run.pk]
    execution = Execution(run.pk, generation, preloaded=loaded)
    execution.run = loaded.run
    execution.root_id = loaded.run.root_id or loaded.run.id
    execution.app_id = loaded.run.app_id
    execution.principal = loaded.run.principal
    execution.journal = RunJournal(execution, loaded)
    execution.ending = RunEnding(execution, execution.journal)
    return execution


def requeue_expired(run: WorkflowRun) -> None:
    """What a crashed worker's run goes through: its lease expires, the reaper queues
    it again (a consecutive failure), and it is due at once."""
    expire_lease(run)
    assert claim.reap_expired("default") == 1
    make_due(run)


def take_over(run: WorkflowRun) -> int:
    """``requeue_expired``, then another worker claims the run (the generation goes up).
    Returns the new holder's generation."""
    requeue_expired(run)
    return claim_for(run, worker_id="new-holder")


def new_step(
    execution: Execution,
    seq: int,
    action: type[Action],
    input: Any = None,
    *,
    invocation: int | None = None,
) -> Step:
    """Step ``seq`` of ``action`` as ``Execution`` builds a new one; ``invocation``: the
    number of its effect's invocation, as the EXTERNAL path keys a dispatch."""
    input = {} if input is None else input
    step = Step(
        seq,
        as_action(action),
        action.action_name(),
        input,
        evidence.hash_value(input),
        clock.now(),
        StepContext(execution, seq),
    )
    if invocation is not None:
        step.ctx.invocation_key = f"{step.ctx.effect_key}:{invocation}"
    return step


def writers(run: WorkflowRun) -> dict[str, list[str]]:
    """The writing transaction of the run row, its journal entries and ledger entries."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT xmin::text FROM k2b_run WHERE id = %s", [run.pk])
        (row,) = cursor.fetchone()
        cursor.execute(
            "SELECT xmin::text FROM k2b_journal WHERE run_id = %s ORDER BY seq", [run.pk]
        )
        entries = [r[0] for r in cursor.fetchall()]
        cursor.execute("SELECT xmin::text FROM k2b_ledger WHERE run_id = %s ORDER BY id", [run.pk])
        ledger = [r[0] for r in cursor.fetchall()]
    return {"run": [row], "journal": entries, "ledger": ledger}


def exhausted_run() -> WorkflowRun:
    run = start_workflow_run("test.flaky", {"times": 100})
    WorkflowRun.objects.filter(pk=run.pk).update(status="running")
    WorkflowRun.objects.filter(pk=run.pk).update(
        status="failed", error_code=WORKFLOW_RETRY_EXHAUSTED
    )
    return run


@contextlib.contextmanager
def run_statistics_never_taken() -> Iterator[None]:
    """``k2b_run`` as PostgreSQL sees a table it never analyzed, until the block ends: a
    bulk enqueue inside it meets no statistics.

    A test of how the claim plans after a bulk enqueue depends on what autovacuum
    happened to analyze before (other tests' runs, or none) and during the test; in
    a full run it varies, and such a test passed alone and failed there (#38). The
    statistics are removed (the test cluster's superuser may) and autovacuum is off
    for the table, so the test meets the state it names."""
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE k2b_run SET (autovacuum_enabled = off)")
        cursor.execute("DELETE FROM pg_catalog.pg_statistic WHERE starelid = 'k2b_run'::regclass")
        cursor.execute(
            """UPDATE pg_catalog.pg_class SET reltuples = -1, relpages = 0, relallvisible = 0
                WHERE oid = 'k2b_run'::regclass"""
        )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE k2b_run RESET (autovacuum_enabled)")


def run_heap_fetches() -> int:
    """Rows of ``k2b_run`` this transaction fetched through its indexes, bitmap scans
    included. The table's own ``tuples_fetched`` counts bitmap scans only: an
    index scan counts its fetches on the index."""
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT pg_stat_get_xact_tuples_fetched('k2b_run'::regclass)
                      + (SELECT coalesce(sum(pg_stat_get_xact_tuples_fetched(indexrelid)), 0)
                           FROM pg_catalog.pg_index WHERE indrelid = 'k2b_run'::regclass)"""
        )
        return int(cursor.fetchone()[0])


def span_edges(key: str) -> list[str]:
    """The edges ("start", "end") of ``flow.span``'s rows of ``key``, in commit order:
    each row is committed by the action itself as it enters and leaves ``run()``."""
    from tests.models import ProviderCall

    rows = ProviderCall.objects.filter(action="flow.span", payload__key=key).order_by("id")
    return [r.payload["edge"] for r in rows]


def most_inside(key: str) -> int:
    """The most actions of ``key`` inside ``run()`` at once, from their own rows."""
    inside = most = 0
    for edge in span_edges(key):
        inside += 1 if edge == "start" else -1
        most = max(most, inside)
    return most
