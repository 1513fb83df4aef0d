"""A pause holds for the whole fleet, through a restart; a resume is claimed at once (#49).

Real ``runworkflows`` processes: the pause is a row every worker's claim reads,
so a live worker stops claiming the queue without being told, and a worker
killed with SIGKILL and started again finds the queue still paused.
"""

from __future__ import annotations

import json
import time

import pytest
from django.db import connection

from k2b_workflows import pause_queue, paused_queues, resume_queue, start_workflow_run
from k2b_workflows.models import WorkflowRun
from tests.models import DomainRow, ProviderCall

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 60  # generous: the machine is shared; the waits end on a condition


def status(run: WorkflowRun) -> str:
    return WorkflowRun.objects.get(pk=run.pk).status


def started(run: WorkflowRun) -> bool:
    """The run's step committed its first row: it was claimed and is running."""
    return ProviderCall.objects.filter(payload__n=run.input["n"]).exists()


def test_a_pause_stops_a_live_worker_claiming_and_holds_through_a_kill_and_a_restart(
    start_worker, wait
):
    worker = start_worker("--concurrency", "2")
    claimed = start_workflow_run("queues.held", {"n": 1, "hold": "release-1"})
    wait(lambda: started(claimed), TIMEOUT, message=worker.report)

    pause_queue("held", reason="the provider is down")
    paused = start_workflow_run("queues.held", {"n": 2})
    other = start_workflow_run("queues.note", {"n": 3}, queue="other")
    # The worker is claiming: the other queue's run ends while the paused one waits.
    wait(lambda: status(other) == "succeeded", TIMEOUT, message=worker.report)
    DomainRow.objects.create(key="release-1")
    # The run it had claimed before the pause finishes.
    wait(lambda: status(claimed) == "succeeded", TIMEOUT, message=worker.report)
    after = start_workflow_run("queues.note", {"n": 4}, queue="other")
    wait(lambda: status(after) == "succeeded", TIMEOUT, message=worker.report)
    assert status(paused) == "queued"
    assert not started(paused)

    worker.kill()  # SIGKILL: nothing of the worker's memory survives
    restarted = start_worker("--concurrency", "2")
    later = start_workflow_run("queues.note", {"n": 5}, queue="other")
    wait(lambda: status(later) == "succeeded", TIMEOUT, message=restarted.report)
    assert status(paused) == "queued"
    assert "held" in paused_queues()

    resume_queue("held")
    wait(lambda: status(paused) == "succeeded", TIMEOUT, message=restarted.report)


def test_a_resume_wakes_an_idle_worker_of_another_app_at_once(start_worker, wait):
    """Polling once a minute, listening for its app "tests" only: the resume's
    notification names no app, and still wakes it."""
    pause_queue("held", reason="deploy")
    run = start_workflow_run("queues.held", {"n": 1})
    worker = start_worker(
        "--app", "tests", "--concurrency", "1", "--no-schedules",
        env={"K2B_TEST_SETTINGS": json.dumps({"POLL_INTERVAL_MS": 60_000})},
    )  # fmt: skip
    other = start_workflow_run("queues.note", {"n": 2})  # its insert notifies app "tests"
    wait(lambda: status(other) == "succeeded", TIMEOUT, message=worker.report)
    resumed_at = time.monotonic()
    resume_queue("held")
    wait(lambda: started(run), TIMEOUT, message=worker.report)
    assert time.monotonic() - resumed_at < 30, "woken by its minute's poll, not by the resume"


def test_a_resumed_queue_is_claimed_within_a_poll_interval_without_a_notification(
    start_worker, wait
):
    pause_queue("held", reason="deploy")
    run = start_workflow_run("queues.held", {"n": 1})
    worker = start_worker("--no-listen", "--concurrency", "1")
    other = start_workflow_run("queues.note", {"n": 2})
    wait(lambda: status(other) == "succeeded", TIMEOUT, message=worker.report)
    # A resume by hand: the row deleted, nobody notified.
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM k2b_queue_pause WHERE queue = 'held'")
    wait(lambda: status(run) == "succeeded", TIMEOUT, message=worker.report)


def test_a_burst_worker_ends_with_a_paused_queues_runs_still_queued(start_worker):
    pause_queue("held", reason="deploy")
    paused = start_workflow_run("queues.held", {"n": 1})
    other = start_workflow_run("queues.note", {"n": 2})
    worker = start_worker("--burst", "--concurrency", "1")
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()
    assert status(other) == "succeeded"
    assert status(paused) == "queued"
