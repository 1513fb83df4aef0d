"""An idle worker's cost: one read-only statement a poll (#52).

A full pass of the loop (claim, AI claim, housekeeping) is a dozen statements
and two transactions; an idle fleet paid it on every poll of every worker. After
a pass that found nothing, the loop probes (``claim.idle_probe_ms``) and makes a
full pass only when the probe finds something to do. These tests run a worker in
a thread of the test process, count the statements its loop sends, and check that
the probe still sees what a full pass would act on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connections
from django.test import override_settings

from k2b_workflows import pause_queue, start_workflow_run
from k2b_workflows.models import WorkflowRun
from k2b_workflows.worker import loop
from k2b_workflows.worker.loop import Worker
from tests.support.processes import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

POLL_MS = 20


class LoopThread(threading.Thread):
    """``Worker.run`` in a thread, counting the statements its loop sends and its full passes."""

    def __init__(self, worker: Worker) -> None:
        super().__init__(daemon=True)
        self.worker = worker
        self.statements: list[str] = []
        self.full_passes = 0
        fill = worker._fill

        def counted_fill(pool: Any) -> int:
            self.full_passes += 1
            return fill(pool)

        worker._fill = counted_fill  # type: ignore[method-assign]

    def run(self) -> None:
        def count(execute: Callable, sql: str, *args: Any) -> Any:
            self.statements.append(sql)
            return execute(sql, *args)

        try:
            with connections["default"].execute_wrapper(count):
                self.worker.run()
        finally:
            connections.close_all()

    def probes(self) -> int:
        return self.worker.stats["idle_probes"]

    def stop(self) -> None:
        self.worker.stop()
        self.join(30)
        assert not self.is_alive()


@pytest.fixture
def idle_worker(monkeypatch) -> Iterator[Callable[..., LoopThread]]:
    # Only the probe may find what the tests make due: no full round comes to help.
    monkeypatch.setattr(loop, "IDLE_FULL_ROUND_S", 600.0)
    started: list[LoopThread] = []

    def start(**kwargs: Any) -> LoopThread:
        thread = LoopThread(Worker(concurrency=2, listen=False, schedules=False, **kwargs))
        started.append(thread)
        thread.start()
        return thread

    with override_settings(K2B_WORKFLOWS={"POLL_INTERVAL_MS": POLL_MS}):
        yield start
        for thread in started:
            if thread.is_alive():
                thread.stop()


def test_an_idle_worker_sends_one_statement_a_poll_and_opens_no_transaction(idle_worker):
    worker = idle_worker()
    wait_for(lambda: worker.probes() >= 5, timeout=30, message="the first probes")
    before, probes = len(worker.statements), worker.probes()
    wait_for(lambda: worker.probes() >= probes + 30, timeout=60, message="30 more probes")
    worker.stop()
    after, done = worker.statements[before:], worker.probes() - probes
    # A probe is listed when it is sent and counted once it has answered: read while one
    # was in flight, the first read lists one probe the count has not, and the last
    # pass may have been under way at the stop. One probe of slack each way.
    assert done - 1 <= len(after) <= done + 1, (done, len(after), after[:2])
    assert all("idle" not in sql and sql.lstrip().startswith("SELECT") for sql in after)
    assert worker.full_passes <= 2, f"{worker.full_passes} full passes while idle"


def test_a_due_run_that_another_worker_takes_does_not_make_every_pass_a_full_one(idle_worker):
    start_workflow_run("test.pure", {"a": 1, "b": 2}, queue="other")
    worker = idle_worker(queues=["mail"])
    wait_for(lambda: worker.probes() >= 30, timeout=60, message="30 probes")
    worker.stop()
    # Read as due for everyone, the other queue's run made the probe say "now" at
    # every poll, and every pass a full one (a hundred a second at the default poll).
    assert worker.full_passes <= 3, f"{worker.full_passes} full passes for {worker.probes()} probes"
    assert WorkflowRun.objects.get().status == "queued"


def test_a_paused_queues_due_run_leaves_the_worker_probing(idle_worker):
    pause_queue("mail", reason="a test")
    start_workflow_run("test.pure", {"a": 1, "b": 2}, queue="mail")
    worker = idle_worker(queues=["mail"])
    wait_for(lambda: worker.probes() >= 30, timeout=60, message="30 probes")
    worker.stop()
    assert worker.full_passes <= 3, f"{worker.full_passes} full passes for {worker.probes()} probes"
    assert WorkflowRun.objects.get().status == "queued"


def test_the_probe_finds_a_run_enqueued_without_a_notification(idle_worker):
    worker = idle_worker(queues=["mail"])
    wait_for(lambda: worker.probes() >= 3, timeout=30, message="the worker probing")
    run = start_workflow_run("test.pure", {"a": 1, "b": 2}, queue="mail")
    # listen=False: no notification wakes the loop; only a probe can see the run.
    wait_for(
        lambda: WorkflowRun.objects.get(pk=run.pk).status == "succeeded",
        timeout=30,
        message="the run claimed through the probe",
    )
    probes = worker.probes()
    wait_for(lambda: worker.probes() >= probes + 3, timeout=30, message="the worker idle again")
    worker.stop()


def test_a_batch_whose_members_all_ended_is_work_the_probe_sees(monkeypatch):
    """A full pass's housekeeping runs at most every half poll: the batch whose last
    member ended just after one is due with nobody told. The probe must see it, or
    its callbacks wait for the loop's next full round."""
    from k2b_workflows.kernel import batches, claim
    from k2b_workflows.tasks import batch_status, enqueue_batch
    from k2b_workflows.testing import run_until_idle
    from tests.tasks_app import batched

    def probe() -> float | None:
        return claim.idle_probe_ms("default", workflows=[])

    monkeypatch.setattr(batches, "fire_due", lambda *args, **kwargs: 0)
    batch = enqueue_batch(
        batched.member, [((n,), None) for n in range(3)], on_finish=batched.on_finish
    )
    run_until_idle()
    assert batch_status(batch.id).finished_at is None
    assert probe() == 0, "a due batch is work for the housekeeping, now"
    monkeypatch.undo()
    run_until_idle()
    assert batch_status(batch.id).finished_at is not None
    run_until_idle()  # the callback's own run
    assert probe() is None
