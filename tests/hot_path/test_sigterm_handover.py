"""On SIGTERM a worker hands back the prefetched runs no thread started."""

from __future__ import annotations

import signal

import pytest

from k2b_workflows import start_workflow_run
from tests.hot_path.helpers import TIMEOUT
from tests.models import ProviderCall
from tests.support.kernel import fresh

pytestmark = pytest.mark.django_db(transaction=True)


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
