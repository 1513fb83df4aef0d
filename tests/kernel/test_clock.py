"""The controlled clock (#12): an hour of backoff, a day of waiting and a lease pass at once.

Each test starts by moving the clock a day or more ahead: a kernel read of
the time that ignored the clock would then be a day off, and the test fails
(a retry or a deadline due at once, a lease expired at its claim), where a
clock that starts at real time would hide it. No test sleeps: ``run_until_idle``
gets a few real seconds for what takes hours on the clock.
"""

from __future__ import annotations

import datetime as dt
import threading
from importlib import metadata

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from k2b_workflows import Action, Dependency, Effect, start_workflow_run, succeeded, waiting
from k2b_workflows.kernel import ai, claim, db
from k2b_workflows.kernel.leases import LeaseKeeper
from k2b_workflows.models import AiTask, JournalEntry, LedgerEntry, WorkflowRun
from k2b_workflows.testing import WorkflowClock, controlled_clock, run_until_idle
from tests.models import ProviderCall
from tests.support.kernel import execute_once, fresh
from tests.support.workflow_steps import one_step

pytest_plugins = ["k2b_workflows.pytest_plugin"]

HOUR_MS = 3_600_000
#: Real seconds ``run_until_idle`` may take for hours on the clock: it must not sleep.
QUICK = 20


class RemindOnce(Action):
    """Waits a day for nothing but its deadline, then succeeds: a reminder."""

    name = "clock.remind_once"
    effect = Effect.PURE

    def run(self, ctx, input):
        asked = ProviderCall.objects.filter(action=self.name, effect_key=ctx.effect_key).exists()
        ProviderCall.objects.create(action=self.name, effect_key=ctx.effect_key)
        if not asked:
            return waiting(Dependency("reminder", ctx.effect_key, deadline=dt.timedelta(days=1)))
        return succeeded({"reminded_at": timezone.now().isoformat()})


one_step("clock.remind_once", RemindOnce, app_id="clock")


def _settings(**values: int) -> override_settings:
    return override_settings(K2B_WORKFLOWS={**settings.K2B_WORKFLOWS, **values})


def _hourly_retries() -> override_settings:
    """A first retry after an hour, doubling (the default cap is five minutes)."""
    return _settings(RETRY_BACKOFF_MS=HOUR_MS, RETRY_BACKOFF_MAX_MS=24 * HOUR_MS)


def _run_is_due(run: WorkflowRun) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT run_after <= k2b_now() FROM k2b_run WHERE id = %s", [run.pk])
        return cursor.fetchone()[0]


def _database_offset(conn=None) -> dt.timedelta:
    """``k2b_now()`` minus the statement's real timestamp, on a Django or a psycopg connection."""
    sql = "SELECT k2b_now() - statement_timestamp()"
    if conn is not None:
        return conn.execute(sql).fetchone()[0]
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_an_hour_of_retry_backoff_passes_on_the_clock_without_sleeping(k2b_clock):
    k2b_clock.advance(days=1)
    run = start_workflow_run("test.flaky", {"times": 2})

    with _hourly_retries():
        stats = run_until_idle(timeout=QUICK)

    assert fresh(run).status == "succeeded"
    assert stats["retry"] == 2
    # Backoff 1 h, then 2 h: run_until_idle moved the clock to each retry, no
    # further (less the real time the test took between the retries).
    waited = k2b_clock.offset - dt.timedelta(days=1)
    assert dt.timedelta(hours=3, minutes=-1) < waited <= dt.timedelta(hours=3)


@pytest.mark.django_db(transaction=True)
def test_hourly_retries_run_out_at_once_on_the_clock(k2b_clock):
    run = start_workflow_run("test.flaky", {"times": 100})

    with _hourly_retries():
        run_until_idle(timeout=QUICK)

    failed = fresh(run)
    assert (failed.status, failed.error_code) == ("failed", "WORKFLOW_RETRY_EXHAUSTED")
    # 1 + 2 + 4 + 8 hours of backoff between the five attempts.
    assert k2b_clock.offset > dt.timedelta(hours=14, minutes=59)


@pytest.mark.django_db(transaction=True)
def test_a_retry_is_due_when_its_backoff_has_passed_on_the_clock_and_not_before(k2b_clock):
    k2b_clock.advance(days=1)
    run = start_workflow_run("test.flaky", {"times": 1})
    with _hourly_retries():
        assert execute_once(run) == "retry"

        k2b_clock.advance(minutes=59)
        assert not _run_is_due(run)
        k2b_clock.advance(minutes=2)
        assert _run_is_due(run)

        before = k2b_clock.offset
        run_until_idle(timeout=QUICK)
    assert fresh(run).status == "succeeded"
    assert k2b_clock.offset == before  # due: nothing left to wait for


@pytest.mark.django_db  # inside the test's own transaction, rolled back at the end
def test_the_clock_works_inside_the_tests_own_transaction(k2b_clock):
    k2b_clock.advance(days=1)
    run = start_workflow_run("test.flaky", {"times": 1})

    with _hourly_retries():
        run_until_idle(timeout=QUICK)

    assert fresh(run).status == "succeeded"
    assert k2b_clock.offset > dt.timedelta(days=1, minutes=59)


@pytest.mark.django_db(transaction=True)
def test_a_wait_deadline_a_day_away_passes_when_the_clock_does(k2b_clock):
    k2b_clock.advance(days=3)
    run = start_workflow_run("test.wait", {"key": "never", "deadline_s": 86_400})
    run_until_idle(timeout=QUICK)
    parked = fresh(run)
    assert parked.status == "waiting"
    assert abs(parked.wait_deadline - (k2b_clock.now() + dt.timedelta(days=1))) < dt.timedelta(
        minutes=1
    )
    asked = ProviderCall.objects.filter(action="test.wait_for")

    k2b_clock.advance(hours=23)
    run_until_idle(timeout=QUICK)
    assert (fresh(run).status, asked.count()) == ("waiting", 1)

    k2b_clock.advance_to(parked.wait_deadline)
    run_until_idle(timeout=QUICK)
    # Promoted at its deadline: asked again (still nothing), parked for another day.
    again = fresh(run)
    assert (again.status, asked.count()) == ("waiting", 2)
    assert again.wait_deadline >= parked.wait_deadline + dt.timedelta(days=1)


@pytest.mark.django_db(transaction=True)
def test_run_until_idle_moves_the_clock_to_a_wait_deadline_when_asked_to(k2b_clock):
    k2b_clock.advance(days=1)
    run = start_workflow_run("clock.remind_once", {})
    run_until_idle(timeout=QUICK)
    deadline = fresh(run).wait_deadline
    assert fresh(run).status == "waiting"

    run_until_idle(timeout=QUICK, wait_for_deadlines=True)

    assert fresh(run).status == "succeeded"
    assert deadline <= k2b_clock.now() < deadline + dt.timedelta(minutes=1)


@pytest.mark.django_db(transaction=True)
def test_a_dead_workers_lease_expires_when_the_clock_passes_it(k2b_clock):
    k2b_clock.advance(days=1)
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    with _settings(RUN_LEASE_MS=HOUR_MS):
        # A worker claims the run and dies before doing anything.
        assert claim.claim_runs(
            "default",
            worker_id="dead",
            workflows=[("test.pure", run.workflow_version)],
            app_ids=None,
            limit=1,
        ) == [(run.pk, 1)]
        run_until_idle(timeout=QUICK)
        assert (fresh(run).status, fresh(run).generation) == ("running", 1)

        k2b_clock.advance(minutes=59)
        run_until_idle(timeout=QUICK)
        assert (fresh(run).status, fresh(run).generation) == ("running", 1)

        k2b_clock.advance(minutes=2)
        run_until_idle(timeout=QUICK)
    taken_over = fresh(run)
    assert (taken_over.status, taken_over.generation) == ("succeeded", 2)


@pytest.mark.django_db(transaction=True)
def test_an_ai_task_whose_worker_died_is_run_again_when_its_lease_passes_on_the_clock(k2b_clock):
    k2b_clock.advance(days=1)
    run = start_workflow_run("fanout.ai", {"request": "hi"})
    assert execute_once(run) == "waiting"
    with _settings(RUN_LEASE_MS=HOUR_MS):
        (task,) = ai.claim_tasks("default", app_ids=["fanout"], limit=1)  # and its worker dies

        k2b_clock.advance(minutes=59)
        run_until_idle(app_ids=["fanout"], timeout=QUICK)
        assert AiTask.objects.get(pk=task[0]).status == "running"

        k2b_clock.advance(minutes=2)
        run_until_idle(app_ids=["fanout"], timeout=QUICK)
    assert AiTask.objects.get(pk=task[0]).attempts == 2
    assert fresh(run).status == "succeeded"


def _lease_left(table: str, pk) -> dt.timedelta:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT lease_expires_at - k2b_now() FROM {table} WHERE id = %s", [pk])
        return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_the_lease_keeper_renews_leases_on_the_clock(k2b_clock):
    run = start_workflow_run("fanout.ai", {"request": "hi"})
    assert execute_once(run) == "waiting"
    (task,) = ai.claim_tasks("default", app_ids=["fanout"], limit=1)
    start_workflow_run("test.pure", {"a": 1, "b": 1})
    ((run_id, generation),) = claim.claim_runs(
        "default", worker_id="here", workflows=[("test.pure", 1)], app_ids=None, limit=1
    )
    keeper = LeaseKeeper("default")
    keeper.track(run_id, generation, threading.Event())
    keeper.track_task(task[0], task[1], threading.Event())
    try:
        k2b_clock.advance(days=1)  # a day in which the keeper renewed, as it would have
        keeper.tick(renew=True)
    finally:
        keeper.stop()
    lease = dt.timedelta(milliseconds=settings.K2B_WORKFLOWS["RUN_LEASE_MS"])
    for table, pk in (("k2b_run", run_id), ("k2b_ai_task", task[0])):
        assert lease - dt.timedelta(seconds=5) < _lease_left(table, pk) <= lease


@pytest.mark.django_db(transaction=True)
def test_an_action_past_its_timeout_on_the_clock_is_told_to_stop_and_not_renewed(k2b_clock):
    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    ((run_id, generation),) = claim.claim_runs(
        "default", worker_id="here", workflows=[("test.pure", 1)], app_ids=None, limit=1
    )
    canceled = threading.Event()
    keeper = LeaseKeeper("default")
    keeper.track(run_id, generation, canceled)
    keeper.action_started(run_id, timeout_s=600)
    try:
        k2b_clock.advance(minutes=9)
        keeper.tick(renew=True)
        assert not canceled.is_set()
        k2b_clock.advance(minutes=2)
        keeper.tick(renew=True)
    finally:
        keeper.stop()
    assert canceled.is_set()  # ctx.canceled: the action's abort signal
    assert _lease_left("k2b_run", run.pk) < dt.timedelta(0)  # left to expire, not renewed


@pytest.mark.django_db(transaction=True)
def test_the_kernel_stamps_runs_journal_and_ledger_on_the_clock(k2b_clock):
    k2b_clock.advance(days=2)
    before = k2b_clock.now()
    run = start_workflow_run("test.charge", {"amount": 1})
    run_until_idle(timeout=QUICK)
    after = k2b_clock.now()

    done = fresh(run)
    stamps = [done.created_at, done.updated_at, done.finished_at]
    stamps += [e.created_at for e in JournalEntry.objects.filter(run=run)]
    stamps += [e.started_at for e in JournalEntry.objects.filter(run=run)]
    stamps += [e.created_at for e in LedgerEntry.objects.filter(run=run)]
    assert len(stamps) >= 6
    assert all(before <= stamp <= after for stamp in stamps), (before, stamps, after)


@pytest.mark.django_db(transaction=True)
def test_every_connection_of_the_kernel_follows_the_clock_and_real_time_comes_back():
    opened_before = db.autocommit_connection("default")  # like the lease keeper's
    listener = db.autocommit_connection("default", follow_clock=False)
    try:
        with controlled_clock() as clock:
            clock.advance(hours=5)
            opened_during = db.autocommit_connection("default")
            for offset in (
                _database_offset(),
                _database_offset(opened_before),
                _database_offset(opened_during),
            ):
                assert offset == dt.timedelta(hours=5)
            assert _database_offset(listener) == dt.timedelta(0)
            assert abs(clock.now() - timezone.now() - dt.timedelta(hours=5)) < dt.timedelta(
                seconds=5
            )
        for conn in (None, opened_before, opened_during):
            assert _database_offset(conn) == dt.timedelta(0)
        opened_during.close()
    finally:
        opened_before.close()
        listener.close()


@pytest.mark.django_db(transaction=True)
def test_a_connection_opened_while_the_clock_runs_follows_it():
    with controlled_clock() as clock:
        clock.advance(minutes=90)
        connection.close()
        assert _database_offset() == dt.timedelta(minutes=90)  # a new connection
    assert _database_offset() == dt.timedelta(0)


@pytest.mark.django_db(transaction=True)
def test_a_thread_that_connects_while_the_clock_runs_follows_its_moves():
    seen: list[dt.timedelta] = []
    first_read, moved = threading.Event(), threading.Event()

    def worker_thread() -> None:
        from django.db import connection as thread_connection

        try:
            seen.append(_database_offset())  # this thread's own, new connection
            first_read.set()
            moved.wait(timeout=10)
            seen.append(_database_offset())
        finally:
            thread_connection.close()

    with controlled_clock() as clock:
        clock.advance(hours=1)
        thread = threading.Thread(target=worker_thread)
        thread.start()
        assert first_read.wait(timeout=10)
        clock.advance(hours=1)
        moved.set()
        thread.join(timeout=10)
    assert seen == [dt.timedelta(hours=1), dt.timedelta(hours=2)]


@pytest.mark.django_db(transaction=True)
def test_without_a_clock_the_kernel_reads_real_time():
    with connection.cursor() as cursor:
        cursor.execute("SELECT k2b_now() = statement_timestamp()")
        assert cursor.fetchone()[0] is True
    assert _database_offset() == dt.timedelta(0)


def test_the_clock_only_moves_forward_and_one_runs_at_a_time(k2b_clock):
    with pytest.raises(ValueError):
        k2b_clock.advance(seconds=-1)
    with pytest.raises(RuntimeError), controlled_clock():
        pass
    assert isinstance(k2b_clock, WorkflowClock)
    assert k2b_clock.offset == dt.timedelta(0)
    assert k2b_clock.advance_to(k2b_clock.now() - dt.timedelta(hours=1)) <= k2b_clock.now()
    assert k2b_clock.offset == dt.timedelta(0)


def test_the_pytest_plugin_is_opt_in():
    registered = {ep.value for ep in metadata.entry_points(group="pytest11")}
    assert "k2b_workflows.pytest_plugin" not in registered


def test_k2b_fast_retries_shortens_the_backoff_for_one_test(k2b_fast_retries):
    from k2b_workflows import store

    assert store.retry_backoff_ms() == 1
