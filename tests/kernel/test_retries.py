"""Retries: backoff, the consecutive-failure limit, conflicts, and commits whose outcome is lost."""

from __future__ import annotations

import datetime as dt
import threading
import time

import psycopg
import pytest
from django.db import DatabaseError, connection, connections
from django.test import override_settings

from k2b_workflows import start_workflow_run
from k2b_workflows.kernel import db
from k2b_workflows.store import WORKFLOW_RETRY_EXHAUSTED
from tests.models import DomainRow, ProviderCall
from tests.support.kernel import (
    describe,
    execute_once,
    expire_lease,
    fresh,
    journal,
    make_due,
    run_to_end,
)
from tests.workflows import kernel as workflows_kernel

pytestmark = pytest.mark.django_db(transaction=True)

SMALL_LIMIT = {
    "RUN_LEASE_MS": 2000,
    "RETRY_BACKOFF_MS": 50,
    "POLL_INTERVAL_MS": 200,
    "RUN_MAX_CONSECUTIVE_FAILURES": 3,
}


@pytest.fixture(autouse=True)
def _clean_probes():
    workflows_kernel.ATTEMPTS.clear()
    workflows_kernel.OBSERVED.clear()


def test_consecutive_failures_are_counted_with_exponential_backoff():
    run = start_workflow_run("test.flaky", {"times": 5})
    delays = []
    for expected in (1, 2, 3):
        assert execute_once(run) == "retry"
        row = fresh(run)
        assert (row.status, row.consecutive_failures) == ("queued", expected)
        delays.append(row.run_after - row.updated_at)
        make_due(run)
    assert delays == [dt.timedelta(milliseconds=ms) for ms in (50, 100, 200)]


@override_settings(K2B_WORKFLOWS=SMALL_LIMIT)
def test_past_the_limit_the_run_fails_retry_exhausted():
    run = start_workflow_run("test.flaky", {"times": 100})
    run_to_end()
    state = describe(run)
    assert (state["status"], state["code"]) == ("failed", WORKFLOW_RETRY_EXHAUSTED)
    assert ProviderCall.objects.filter(action="test.flaky").count() == 3


@override_settings(K2B_WORKFLOWS=SMALL_LIMIT)
def test_the_third_failure_in_a_row_fails_the_run_there_and_then():
    """The bound holds at the attempt that reaches it, with no claim after it."""
    run = start_workflow_run("test.flaky", {"times": 100})
    for _ in range(2):
        assert execute_once(run) == "retry"
        make_due(run)
    assert execute_once(run) == "failed"
    assert describe(run)["code"] == WORKFLOW_RETRY_EXHAUSTED
    assert ProviderCall.objects.filter(action="test.flaky").count() == 3


@override_settings(K2B_WORKFLOWS=SMALL_LIMIT)
def test_a_run_claimed_at_the_limit_fails_without_running_a_step():
    """The claim's backstop: a crash counted by the reaper reaches the limit unseen."""
    run = start_workflow_run("test.flaky", {"times": 100})
    type(run).objects.filter(pk=run.pk).update(consecutive_failures=3)
    assert execute_once(run) == "failed"
    assert describe(run)["code"] == WORKFLOW_RETRY_EXHAUSTED
    assert ProviderCall.objects.filter(action="test.flaky").count() == 0


@override_settings(K2B_WORKFLOWS=SMALL_LIMIT)
def test_a_completed_step_resets_the_failure_counter():
    # Two steps failing twice each: four failures in all, never three in a row.
    run = start_workflow_run("kernel.two_flaky", {"times": 2})
    run_to_end()
    done = fresh(run)
    assert done.status == "succeeded", describe(run)
    assert done.output == {"a": 3, "b": 3}
    assert done.consecutive_failures == 0


@override_settings(K2B_WORKFLOWS={**SMALL_LIMIT, "RUN_MAX_CONSECUTIVE_FAILURES": 1})
def test_exhausted_with_an_unresolved_external_effect_needs_attention_instead():
    run = start_workflow_run("kernel.external_probe", {"crash_first": True})
    with pytest.raises(workflows_kernel.SimulatedCrash):
        execute_once(run)  # dispatched, then the "process" died
    expire_lease(run)
    run_to_end()
    state = describe(run)
    assert (state["status"], state["code"]) == ("needs_attention", WORKFLOW_RETRY_EXHAUSTED)
    assert fresh(run).attention_step == 0
    # Nothing ran the effect again, nor asked the provider: an operator decides.
    assert ProviderCall.objects.filter(action="kernel.external_probe.attempt").count() == 1


# -- database conflicts --------------------------------------------------------


def test_a_deadlock_in_a_transactional_action_is_retried_in_the_same_claim():
    DomainRow.objects.create(key="A")
    DomainRow.objects.create(key="B")
    run = start_workflow_run("kernel.tx_deadlock", {"a": "A", "b": "B"})
    assert execute_once(run) == "succeeded"
    assert {"deadlock_sqlstate": "40P01"} in workflows_kernel.OBSERVED
    assert DomainRow.objects.get(key="A").value == {"attempt": 2}
    done = fresh(run)
    assert (done.status, done.consecutive_failures) == ("succeeded", 0)
    assert [e.seq for e in journal(run)] == [0]


def _concurrent_update(row_id: int) -> None:
    wrapper = connections["default"]
    other = wrapper.get_new_connection(wrapper.get_connection_params())
    other.autocommit = True
    other.execute(
        "UPDATE tests_domainrow SET generation = generation + 100 WHERE id = %s", [row_id]
    )
    other.close()


def test_a_serialization_failure_is_a_conflict_and_run_in_transaction_retries_it():
    row = DomainRow.objects.create(key="counter", generation=0)
    errors: list[str | None] = []
    attempts = []

    def body() -> int:
        attempts.append(1)
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
            cursor.execute("SELECT generation FROM tests_domainrow WHERE id = %s", [row.pk])
            seen = cursor.fetchone()[0]
            if len(attempts) == 1:
                _concurrent_update(row.pk)  # commits after our snapshot
            try:
                cursor.execute(
                    "UPDATE tests_domainrow SET generation = %s WHERE id = %s", [seen + 1, row.pk]
                )
            except DatabaseError as exc:
                errors.append(db.sqlstate(exc))
                assert db.is_conflict(exc)
                raise
        return seen

    assert db.run_in_transaction(body, "default") == 100
    assert errors == ["40001"]
    assert len(attempts) == 2
    assert DomainRow.objects.get(pk=row.pk).generation == 101


def test_other_database_errors_are_not_conflicts():
    with pytest.raises(DatabaseError) as info:
        db.run_in_transaction(lambda: DomainRow.objects.create(key=None), "default")
    assert db.sqlstate(info.value) == "23502"
    assert not db.is_conflict(info.value)


# -- a commit whose outcome is lost ---------------------------------------------

SLOW_COMMIT = """
CREATE OR REPLACE FUNCTION tests_slow_commit() RETURNS trigger AS $$
BEGIN
  IF NEW.key LIKE 'slowcommit%' THEN PERFORM pg_sleep(30); END IF;
  RETURN NULL;
END $$ LANGUAGE plpgsql;
CREATE CONSTRAINT TRIGGER tests_slow_commit AFTER INSERT ON tests_domainrow
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION tests_slow_commit();
"""


@pytest.fixture
def slow_commit():
    """A deferred trigger that makes COMMIT of a 'slowcommit' row sleep: a window to cut it."""
    with connection.cursor() as cursor:
        cursor.execute(SLOW_COMMIT)
    yield
    with connection.cursor() as cursor:
        cursor.execute(
            "DROP TRIGGER IF EXISTS tests_slow_commit ON tests_domainrow;"
            " DROP FUNCTION IF EXISTS tests_slow_commit();"
        )


def _terminate_the_committing_backend(stop: threading.Event, killed: list[int]) -> None:
    """Cut the backend sleeping in COMMIT. Only a COMMIT sleeps (the trigger is
    deferred); it may be a statement of its own, or the last of a message that
    sends the step's journal entry with it, past what pg_stat_activity shows."""
    wrapper = connections["default"]
    conn = wrapper.get_new_connection(wrapper.get_connection_params())
    conn.autocommit = True
    try:
        while not stop.is_set():
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event = 'PgSleep'"
                " AND datname = current_database()"
            ).fetchall()
            if rows:
                for (pid,) in rows:
                    conn.execute("SELECT pg_terminate_backend(%s)", [pid])
                    killed.append(pid)
                return
            time.sleep(0.02)
    finally:
        conn.close()


def test_a_connection_lost_during_commit_is_resolved_by_rereading_the_journal(slow_commit):
    run = start_workflow_run("kernel.tx_probe", {"key": "slowcommit"})
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_terminate_the_committing_backend, args=(stop, killed))
    killer.start()
    try:
        outcome = execute_once(run)
    finally:
        stop.set()
        killer.join(10)
    assert killed, "the commit was never cut"
    assert outcome == "commit_unknown"
    # Nothing was guessed: the run went back to the queue, and the journal says the
    # commit did not happen, so the next claim runs the step again.
    assert fresh(run).status == "queued"
    assert journal(run) == []
    assert not DomainRow.objects.exists()
    with connection.cursor() as cursor:
        cursor.execute("DROP TRIGGER tests_slow_commit ON tests_domainrow")
    run_to_end()
    assert fresh(run).status == "succeeded"
    assert list(DomainRow.objects.values_list("key", flat=True)) == ["slowcommit:2"]
    assert [e.seq for e in journal(run)] == [0]


def test_psycopg_classes_conflicts_by_sqlstate_not_by_class():
    # Why the kernel reads sqlstate: 40001 is an OperationalError, not TransactionRollback.
    assert issubclass(psycopg.errors.SerializationFailure, psycopg.OperationalError)
    assert db.is_conflict(psycopg.errors.SerializationFailure())
    assert db.is_conflict(psycopg.errors.DeadlockDetected())
    assert not db.is_conflict(psycopg.errors.UniqueViolation())
