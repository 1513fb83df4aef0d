"""``manage.py runworkflows``: --burst, a graceful SIGTERM, --app."""

from __future__ import annotations

import signal

import pytest

from k2b_workflows import start_workflow_run
from tests.kernel_helpers import fresh, journal
from tests.models import ProviderCall

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 90


def test_burst_exits_zero_when_nothing_is_left(start_worker):
    runs = [start_workflow_run("test.pure", {"a": i, "b": 1}) for i in range(3)]
    worker = start_worker("--burst", "--concurrency", "2")
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()
    assert [fresh(r).status for r in runs] == ["succeeded"] * 3


def test_burst_with_nothing_to_do_exits_zero(start_worker):
    worker = start_worker("--burst")
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()


def test_sigterm_lets_the_current_step_finish_and_releases_the_run(start_worker, wait):
    run = start_workflow_run("kernel.slow", {"seconds": 2})
    worker = start_worker("--concurrency", "1")
    wait(
        lambda: ProviderCall.objects.filter(action="kernel.slow").exists(),
        timeout=TIMEOUT,
        message=f"the slow step to start:\n{worker.output()}",
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()

    stopped = fresh(run)
    assert stopped.status == "queued", "released, not left running with a lease"
    assert stopped.consecutive_failures == 0
    assert [e.action_name for e in journal(run)] == ["kernel.slow"]

    later = start_worker("--burst", "--concurrency", "1")
    assert later.wait(timeout=TIMEOUT) == 0, later.output()
    assert fresh(run).status == "succeeded"
    assert ProviderCall.objects.filter(action="kernel.slow").count() == 1


def test_app_runs_only_that_apps_workflows(start_worker):
    ours = start_workflow_run("kernel.other_app", {})
    theirs = start_workflow_run("test.pure", {"a": 1, "b": 1})
    worker = start_worker("--app", "kernel_other", "--burst")
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()
    assert fresh(ours).status == "succeeded"
    assert fresh(theirs).status == "queued"
