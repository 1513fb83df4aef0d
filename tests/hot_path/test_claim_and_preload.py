"""A claim and its preload: one transaction in two round trips, the raw preload
reading what the ORM reads, and a claim that stops early in a large backlog."""

from __future__ import annotations

import pytest
from django.db import connection

from k2b_workflows import start_workflow_run
from k2b_workflows.kernel import claim
from k2b_workflows.kernel.load import preload
from k2b_workflows.models import LedgerEntry, WorkflowRun
from tests.hot_path.helpers import _round_trips
from tests.support.kernel import fresh, journal, run_heap_fetches, run_statistics_never_taken

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_claim_and_its_preload_are_one_transaction_in_two_round_trips(prepares):
    """ "BEGIN; claim", then "preload; COMMIT": where Django's transaction took four
    (BEGIN, claim, preload, COMMIT). A claim that finds nothing rolls back."""
    from k2b_workflows.worker.loop import Worker

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


def test_the_raw_preload_reads_what_the_orm_reads():
    run = start_workflow_run("hot.external_then_pure", {"n": 0})
    from tests.support.kernel import run_to_end

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


def test_a_claim_reads_a_few_rows_of_a_large_backlog_postgresql_has_not_analyzed(prepares):
    """Right after a bulk enqueue, before any ANALYZE, PostgreSQL expects a handful of
    queued runs: without the claim's plan setting it read all of them into a
    bitmap and sorted them at every claim. The claim must walk the index and stop."""
    with run_statistics_never_taken():
        _enqueue_copies(20000)
        _claim_four_reading_few_rows()


def test_a_claim_walks_the_line_when_another_index_finds_the_queued_runs_as_cheaply(prepares):
    """Which index PostgreSQL takes for an unanalyzed backlog is a near tie: each
    expects a handful of rows. The full suite once found ``k2b_run_queued_queue``
    cheaper (its size after the earlier tests decided), read all 20,000 queued runs
    through it and sorted them. An index on the workflow's name and version, as a
    project might add for its reports, ties the same way on every run: the claim
    must still walk ``k2b_run_queued`` and stop."""
    with run_statistics_never_taken():
        _enqueue_copies(20000)
        _claim_four_reading_few_rows(
            "CREATE INDEX k2b_run_by_workflow ON k2b_run (workflow_name, workflow_version)"
        )


def _enqueue_copies(copies: int) -> None:
    """Copies of one queued run (never executed), without a notification each."""
    from django.db import transaction

    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL session_replication_role = replica")
        cursor.execute(
            """INSERT INTO k2b_run
               SELECT copy.*
                 FROM k2b_run r, generate_series(1, %s) n,
                      jsonb_populate_record(NULL::k2b_run, to_jsonb(r)
                          || jsonb_build_object('id', gen_random_uuid(), 'n', n)) copy
                WHERE r.id = %s""",
            [copies, run.pk],
        )


def _claim_four_reading_few_rows(*first: str) -> None:
    """Claim 4 runs (after the statements ``first``, in the same transaction, rolled back)
    and check the claim fetched a few rows of ``k2b_run``, not the backlog."""
    from django.db import transaction

    with transaction.atomic(), connection.cursor() as cursor:
        for statement in first:
            cursor.execute(statement)
        before = run_heap_fetches()
        claimed = claim.claim_runs(
            "default", worker_id="test", workflows=[("test.pure", 1)], app_ids=None, limit=4
        )
        assert len(claimed) == 4
        assert run_heap_fetches() - before < 100
        transaction.set_rollback(True)


def test_a_claim_is_never_compiled():
    """Before PostgreSQL 18 the claim's disabled sort adds its penalty to the plan's
    cost, past ``jit_above_cost``: without ``jit = off`` every claim was compiled,
    300 ms of the server's CPU each, and a worker made a tenth of its steps."""
    from django.db import transaction

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_catalog.pg_jit_available()")
        if not cursor.fetchone()[0]:
            pytest.skip("this PostgreSQL server has no JIT")
    for n in range(20):
        start_workflow_run("test.pure", {"a": 1, "b": n})
    statement = claim.claim_statement("test", [("test.pure", 1)], None, 4)
    assert statement is not None
    sql, params = statement
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("ANALYZE k2b_run")
        cursor.execute(claim.CLAIM_PLAN)
        cursor.execute("EXPLAIN (ANALYZE) " + sql, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    assert "Index Scan using k2b_run_queued on k2b_run" in plan, plan
    assert "JIT" not in plan, plan


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


def test_a_claim_takes_no_more_runs_than_asked_whatever_the_plan(prepares):
    """The runs to claim are picked once. Planned as a semi join with the pick on its
    inner side (statistics that predate a bulk enqueue gave that plan; the settings
    below force it), a pick written as ``IN (SELECT ... LIMIT n FOR UPDATE SKIP
    LOCKED)`` ran again for each row of ``k2b_run``, each time past the runs the
    statement had already updated: a claim of 4 took 5 to 7."""
    from django.db import transaction

    runs = [start_workflow_run("test.pure", {"a": 1, "b": n}) for n in range(12)]
    with transaction.atomic():
        with connection.cursor() as cursor:
            for setting in ("hashjoin", "mergejoin", "hashagg", "material", "sort"):
                cursor.execute(f"SET LOCAL enable_{setting} = off")
        claimed = claim.claim_runs(
            "default", worker_id="test", workflows=[("test.pure", 1)], app_ids=None, limit=4
        )
        assert len(claimed) == 4
        running = WorkflowRun.objects.filter(pk__in=[r.pk for r in runs], status="running")
        assert running.count() == 4
        transaction.set_rollback(True)


def test_a_claims_preload_reads_each_runs_own_ledger_entries_not_the_whole_ledger():
    """The preload runs in the claim's transaction, planned without sorts
    (``claim.CLAIM_PLAN``). Asked for a run's ledger in ``id`` order, PostgreSQL
    walked the ledger's primary key instead of sorting, reading every run's entries
    for each claimed run (84 ms a claim over 3,000 tasks' entries, growing with
    the table). The preload reads each run's own entries and orders them itself.
    PostgreSQL 16 and later plan an aggregate's ORDER BY that way (presorted input);
    PostgreSQL 15 sorts inside the aggregate, so the test can only fail on 16 and
    later: the README's path (the embedded PostgreSQL 18) runs it in CI."""
    from django.db import transaction

    from k2b_workflows.kernel.load import preload_statement
    from tests.support.kernel import run_to_end

    runs = [start_workflow_run("hot.external_then_pure", {"n": n}) for n in range(40)]
    run_to_end()
    with connection.cursor() as cursor:
        # A ledger of many runs' entries: each of the 40 runs' entries, 100 times over
        # (copies of other runs' entries, as the table would hold them).
        columns = [f.column for f in LedgerEntry._meta.concrete_fields if f.column != "id"]
        listed = ", ".join(columns)
        cursor.execute(
            f"INSERT INTO k2b_ledger ({listed}) SELECT {listed} FROM k2b_ledger"
            " CROSS JOIN generate_series(1, 100) WHERE run_id <> ALL(%s)",
            [[r.pk for r in runs[:4]]],
        )
        cursor.execute("ANALYZE k2b_ledger")
        cursor.execute("ANALYZE k2b_journal")
        cursor.execute("ANALYZE k2b_run")
    statement, params = preload_statement([r.pk for r in runs[:4]])
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(claim.CLAIM_PLAN)
        cursor.execute("EXPLAIN (ANALYZE, COSTS OFF) " + statement, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "k2b_ledger_pkey" not in plan, plan
    assert "k2b_ledger_step" in plan, plan
    # And in its order: the chain's, by id.
    loaded = preload("default", [runs[0].pk])[runs[0].pk]
    ids = [entry.id for entry in loaded.ledger]
    assert len(ids) >= 2 and ids == sorted(ids)
