"""LISTEN/NOTIFY is only a wake-up: rolled-back notifications never arrive, polling finds runs.

The worker listens on a dedicated autocommit connection. These tests check
what the kernel relies on (PostgreSQL drops the notifications of a rolled-back
transaction) and what it must not rely on (a notification arriving at all).
"""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection, transaction

from k2b_workflows import notify_workflow_worker, start_workflow_run
from k2b_workflows.models import WorkflowRun
from k2b_workflows.store import CHANNEL
from k2b_workflows.testing import run_until_idle
from tests.workflows.waits import open_gate

pytestmark = pytest.mark.django_db(transaction=True)


def refresh(run: WorkflowRun) -> WorkflowRun:
    return WorkflowRun.objects.get(pk=run.pk)


def parked(key: str) -> WorkflowRun:
    run = start_workflow_run("waits.gate", {"key": key})
    run_until_idle(app_ids=["tests"])
    assert refresh(run).status == "waiting"
    return run


def listen_backends() -> list[int]:
    """Backend pids of connections to the test database whose last statement was the
    workers' LISTEN (not the start-up probe's, on a channel of its own:
    k2b_workflows.worker.topology)."""
    from k2b_workflows import store

    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT pid FROM pg_stat_activity
                WHERE datname = current_database() AND pid <> pg_backend_pid()
                  AND query = %s""",
            [f"LISTEN {store.CHANNEL}"],
        )
        return [row[0] for row in cursor.fetchall()]


def test_notifications_of_a_rolled_back_transaction_are_never_delivered():
    run = parked("never-committed")
    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        with pytest.raises(RuntimeError), transaction.atomic():
            start_workflow_run("test.pure", {"a": 1, "b": 1})  # trigger: pg_notify
            open_gate("never-committed")  # re-queues the run: pg_notify
            notify_workflow_worker("tests")
            raise RuntimeError("roll back")
        notify_workflow_worker("marker")  # committed: delivered after anything before it

        received = []
        for note in listener.notifies(timeout=10):
            if note.payload == "marker":
                break
            received.append(note.payload)
        else:
            pytest.fail("the committed marker notification never arrived")

    assert received == []
    assert refresh(run).status == "waiting"


def test_a_worker_that_does_not_listen_still_finds_woken_runs_by_polling(start_worker, wait):
    run = parked("polled")
    start_worker("--no-listen", "--concurrency", "1")

    open_gate("polled", "found")

    wait(lambda: refresh(run).status == "succeeded", message="the poll to find the woken run")
    assert listen_backends() == []


@pytest.mark.slow
def test_worker_reconnects_its_listener_after_the_backend_is_killed(start_worker, wait):
    first, second = parked("after-kill-1"), parked("after-kill-2")
    worker = start_worker("--concurrency", "1")
    [old] = wait(listen_backends, message="the worker's LISTEN connection")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [old])

    # Runnable while the listener is down or reconnecting: polling finds it.
    open_gate("after-kill-1")
    wait(lambda: refresh(first).status == "succeeded", message="the run woken during the outage")

    new = wait(
        lambda: [pid for pid in listen_backends() if pid != old],
        message="the listener to reconnect",
    )
    assert old not in listen_backends() and len(new) == 1
    open_gate("after-kill-2")
    wait(lambda: refresh(second).status == "succeeded", message="a run woken after reconnecting")
    assert "listener:" in worker.output()
