"""Waiting for a run's result: woken by the run's end notification, not by polling.

Every test that proves the notification sets ``POLL_INTERVAL_MS`` to a minute
and waits with a 30 s timeout: a wait that returns well before it (``Waiter``
allows half) was woken by the end's NOTIFY. Without the ``notify_ended``
trigger the read at the timeout finds the run ended, too late: they fail.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.test import override_settings

from k2b_workflows import (
    InvalidInput,
    cancel_workflow_run,
    start_workflow_run,
    wait_for_workflow_run,
)
from k2b_workflows import results as results_module
from k2b_workflows.kernel import seals
from k2b_workflows.models import WorkflowRun
from k2b_workflows.testing import run_until_idle
from tests.support.processes import wait_for
from tests.workflows.waits import open_gate

pytestmark = pytest.mark.django_db(transaction=True)

NO_POLLING = override_settings(
    K2B_WORKFLOWS={"RUN_LEASE_MS": 2000, "RETRY_BACKOFF_MS": 50, "POLL_INTERVAL_MS": 60_000}
)


class Waiter(threading.Thread):
    """``wait_for_workflow_run`` in a thread of its own, as a view's request would."""

    def __init__(self, run: WorkflowRun, timeout: float = 30) -> None:
        super().__init__(daemon=True)
        self.run_id, self.timeout = run.pk, timeout
        self.result: Any = None
        self.error: BaseException | None = None
        self.elapsed = 0.0

    def run(self) -> None:
        start = time.monotonic()
        try:
            self.result = wait_for_workflow_run(self.run_id, timeout=self.timeout)
            self.elapsed = time.monotonic() - start
        except BaseException as exc:
            self.error = exc
        finally:
            connections.close_all()

    def outcome(self) -> WorkflowRun:
        self.join(60)
        assert not self.is_alive()
        if self.error is not None:
            raise self.error
        assert self.elapsed < self.timeout / 2, f"woken only after {self.elapsed:.1f} s"
        return self.result


@pytest.fixture
def reads(monkeypatch):
    """Counts the waiters' reads of the run, so a test ends the run only after one."""
    counter = {"n": 0}
    original = results_module.settled_run

    def counted(using, run_id):
        value = original(using, run_id)
        counter["n"] += 1
        return value

    monkeypatch.setattr(results_module, "settled_run", counted)
    return counter


def parked(key: str) -> WorkflowRun:
    run = start_workflow_run("waits.gate", {"key": key})
    run_until_idle(app_ids=["tests"])
    assert WorkflowRun.objects.get(pk=run.pk).status == "waiting"
    return run


def waiting_on(run: WorkflowRun, reads: dict[str, int]) -> Waiter:
    waiter = Waiter(run)
    waiter.start()
    wait_for(lambda: reads["n"] >= 1 and results_module.listener.listening.is_set())
    return waiter


@NO_POLLING
def test_wait_returns_the_succeeded_run_when_a_worker_ends_it(reads):
    run = parked("result-ok")
    waiter = waiting_on(run, reads)
    open_gate("result-ok", 7)
    run_until_idle(app_ids=["tests"])
    ended = waiter.outcome()
    assert ended.status == "succeeded"
    assert ended.output == {"value": 7}


@NO_POLLING
def test_wait_returns_a_canceled_run(reads):
    run = parked("result-cancel")
    waiter = waiting_on(run, reads)
    cancel_workflow_run(run.pk, "not needed")
    ended = waiter.outcome()
    assert (ended.status, ended.error_code) == ("canceled", "CANCELED")


@NO_POLLING
def test_wait_returns_for_needs_attention_and_failed(reads):
    run = parked("result-attention")
    waiter = waiting_on(run, reads)
    WorkflowRun.objects.filter(pk=run.pk).update(status="queued")
    WorkflowRun.objects.filter(pk=run.pk).update(status="running")
    generation = WorkflowRun.objects.get(pk=run.pk).generation
    WorkflowRun.objects.filter(pk=run.pk).update(
        status="needs_attention",
        error_code="EFFECT_OUTCOME_UNKNOWN",
        # As the kernel parks a run: sealed (a waiter refuses an unsealed end).
        end_seal=seals.end_seal(run.pk, "needs_attention", "EFFECT_OUTCOME_UNKNOWN", generation),
    )
    assert waiter.outcome().status == "needs_attention"

    failing = start_workflow_run("test.bad_result", {})
    waiter = waiting_on(failing, reads)
    run_until_idle(app_ids=["tests"])
    ended = waiter.outcome()
    assert (ended.status, ended.error_code) == ("failed", "INVALID_ACTION_RESULT")


def test_a_run_not_ended_by_the_timeout_raises_timeout_error():
    run = parked("result-timeout")
    with pytest.raises(TimeoutError, match=str(run.pk)):
        wait_for_workflow_run(run.pk, timeout=0.2)


def test_an_ended_run_is_returned_at_once_and_a_run_instance_is_accepted():
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    run_until_idle(app_ids=["tests"])
    assert wait_for_workflow_run(run, timeout=1).output == {"total": 4}
    assert wait_for_workflow_run(str(run.pk)).status == "succeeded"


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "5", True])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused(timeout):
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    with pytest.raises(InvalidInput, match="timeout"):
        wait_for_workflow_run(run.pk, timeout=timeout)


def test_an_unknown_or_malformed_run_id_is_a_clear_error():
    missing = uuid.uuid4()
    with pytest.raises(WorkflowRun.DoesNotExist, match=f"run_id: no run {missing}"):
        wait_for_workflow_run(missing, timeout=1)
    with pytest.raises(InvalidInput, match="run_id"):
        wait_for_workflow_run("not-a-uuid")


def test_waiting_inside_the_transaction_that_started_the_run_is_refused():
    with transaction.atomic():
        run = start_workflow_run("test.pure", {"a": 1, "b": 2})
        with pytest.raises(InvalidInput, match="has not committed"):
            wait_for_workflow_run(run.pk, timeout=5)


def test_waiting_inside_the_transaction_that_started_the_run_in_a_savepoint_is_refused():
    """A run inserted inside a nested ``atomic()`` (a ``TestCase``'s test, a view's own block
    under ``ATOMIC_REQUESTS``) carries the savepoint's transaction id, not the top-level one:
    compared with the top-level id alone, the wait did not see it as its own and sat until
    its timeout instead of saying why (#38)."""
    with transaction.atomic():
        WorkflowRun.objects.exists()  # the caller's own work first
        with transaction.atomic():
            run = start_workflow_run("test.pure", {"a": 1, "b": 2})
        started = time.monotonic()
        with pytest.raises(InvalidInput, match="has not committed"):
            wait_for_workflow_run(run.pk, timeout=5)
        assert time.monotonic() - started < 4


def test_waiting_inside_an_unrelated_transaction_sees_the_end_committed_elsewhere(reads):
    run = parked("result-atomic")
    with transaction.atomic():
        WorkflowRun.objects.filter(pk=run.pk).exists()  # the caller's own work
        woken = threading.Event()

        def finish() -> None:
            wait_for(lambda: reads["n"] >= 1)
            open_gate("result-atomic", 1)
            run_until_idle(app_ids=["tests"])
            connections.close_all()
            woken.set()

        threading.Thread(target=finish, daemon=True).start()
        assert wait_for_workflow_run(run.pk, timeout=30).status == "succeeded"


@NO_POLLING
def test_the_listener_reconnects_and_wakes_its_waiters_after_losing_its_connection(reads):
    run = parked("result-reconnect")
    waiter = waiting_on(run, reads)
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                WHERE datname = current_database() AND query ILIKE 'LISTEN k2b_run_ended%%'"""
        )
        assert cursor.fetchone() is not None
    open_gate("result-reconnect", 3)
    run_until_idle(app_ids=["tests"])
    assert waiter.outcome().output == {"value": 3}


def _notified_ends(ended: Any) -> list[str]:
    """The run ids ``k2b_run_ended`` carried while ``ended()`` ended runs (a listener of
    its own, in autocommit, as every listener is)."""
    import psycopg

    from k2b_workflows.models import ENDED_CHANNEL

    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as listening:
        listening.execute(f"LISTEN {ENDED_CHANNEL}")
        ended()
        return [n.payload for n in listening.notifies(timeout=1.0)]


def test_a_run_nobody_waits_for_ends_without_a_notification():
    """A NOTIFY wakes every listening backend of the database (each worker's, on any
    channel) into a transaction of its own: a run's end notifies only a waiter."""
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    assert _notified_ends(lambda: run_until_idle(app_ids=["tests"])) == []
    assert WorkflowRun.objects.get(pk=run.pk).status == "succeeded"


def test_a_waiters_lock_makes_the_end_notify_and_an_end_in_progress_refuses_it():
    """A waiter holds its run's lock from before its first read: the end then notifies.
    While an end holds the lock (not committed yet), a waiter is refused it and reads
    the run again at its next poll, by when the end has committed or rolled back."""
    import psycopg

    waited = start_workflow_run("test.pure", {"a": 1, "b": 3})
    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as waiter:
        lock = results_module._WAIT_ON_SQL
        assert waiter.execute(lock, [str(waited.pk)]).fetchone()[0] is True
        assert _notified_ends(lambda: run_until_idle(app_ids=["tests"])) == [str(waited.pk)]

        other = start_workflow_run("test.pure", {"a": 1, "b": 4})
        with transaction.atomic():
            WorkflowRun.objects.filter(pk=other.pk).update(status="canceled")
            assert waiter.execute(lock, [str(other.pk)]).fetchone()[0] is False
        assert waiter.execute(lock, [str(other.pk)]).fetchone()[0] is True
