"""``cancel_workflow_run`` of a running workflow run asks it (#49), under real workers.

The failure this guards against: a cancel that ended a running run at once, so
that an external step in flight (a card being charged) had its answer thrown
away: the charge happened, the run said nothing of it. Asked, the run's current
step finishes and commits its result and its effect records under the fence as
usual; then no further step starts, and the run ends canceled. A worker killed
after the request leaves a run that the takeover ends canceled without starting
anything. A run that is not running (queued, parked) still ends at once.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from k2b_workflows import cancel_workflow_run, start_workflow_run
from k2b_workflows.kernel.leases import LeaseKeeper
from k2b_workflows.models import WorkflowRun
from tests.models import ProviderCall
from tests.support.kernel import describe, fresh, journal, ledger_kinds
from tests.support.misuse import verify

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TIMEOUT = 90  # generous: the machine is shared; only the request's latency is measured
ENDED = ("succeeded", "failed", "canceled", "needs_attention")


def _calls(action: str) -> list[ProviderCall]:
    return list(ProviderCall.objects.filter(action=action).order_by("id"))


def _started(worker, wait) -> None:
    wait(
        lambda: _calls("holders.started"),
        timeout=TIMEOUT,
        message=lambda: f"the step to start:\n{worker.report()}",
    )


def _release(run: WorkflowRun, step: int = 0) -> None:
    ProviderCall.objects.create(action="holders.release", effect_key=f"{run.pk}:{step}")


def _ended(worker, wait, run: WorkflowRun) -> WorkflowRun:
    wait(
        lambda: fresh(run).status in ENDED,
        timeout=TIMEOUT,
        message=lambda: f"the run to end: {describe(run)}\n{worker.report()}",
    )
    return fresh(run)


def test_a_running_run_is_asked_its_step_commits_and_the_next_never_starts(start_worker, wait):
    worker = start_worker("--concurrency", "1")
    run = start_workflow_run("holders.charge_then_ship", {"until_released": True})
    _started(worker, wait)

    asked = cancel_workflow_run(run.pk, "customer left")
    assert asked.status == "running", describe(run)  # asked, not ended
    assert asked.cancel_requested_at is not None
    _release(run)  # the provider answers: the card was charged

    done = _ended(worker, wait, run)
    assert (done.status, done.error_code) == ("canceled", "CANCELED"), describe(run)
    assert done.error_message.startswith("customer left ("), done.error_message
    # The charge and its answer are the run's: journaled, its ledger complete.
    (charge,) = _calls("holders.slow_charge")
    assert [(e.seq, e.state, e.output) for e in journal(run)] == [
        (0, "succeeded", {"charge_id": f"ch_{charge.pk}"})
    ]
    assert ledger_kinds(run) == ["dispatched", "succeeded"]
    assert _calls("holders.shipped") == []  # the step after it never started
    assert "FAILED" not in verify(), verify()


def test_a_step_reads_the_request_in_ctx_canceled_and_its_result_is_kept(start_worker, wait):
    worker = start_worker("--concurrency", "1")
    run = start_workflow_run("holders.held_then_ship", {"until_canceled": True})
    _started(worker, wait)
    asked_at = time.time()
    cancel_workflow_run(run.pk, "stop")
    seen = wait(
        lambda: ProviderCall.objects.filter(action="holders.saw_cancel").first(),
        timeout=TIMEOUT,
        message=lambda: f"the step to see ctx.canceled:\n{worker.report()}",
    )
    latency = seen.payload["at"] - asked_at
    print(f"ctx.canceled seen by the running step after {latency * 1000:.0f} ms")
    assert latency < 1.0, latency
    done = _ended(worker, wait, run)
    assert (done.status, done.error_code) == ("canceled", "CANCELED"), describe(run)
    assert [(e.seq, e.output) for e in journal(run)] == [(0, {"held": f"{run.pk}:0"})]
    assert _calls("holders.shipped") == []


def test_a_run_whose_worker_is_killed_after_the_request_ends_canceled_at_the_takeover(
    start_worker, wait
):
    worker = start_worker("--concurrency", "1")
    run = start_workflow_run("holders.held_then_ship", {})
    _started(worker, wait)
    cancel_workflow_run(run.pk, "stop")
    worker.kill()  # SIGKILL, inside the step
    _release(run)
    other = start_worker("--concurrency", "1")
    done = _ended(other, wait, run)
    assert (done.status, done.error_code) == ("canceled", "CANCELED"), describe(run)
    assert done.generation == 2, describe(run)  # the takeover ended it
    assert len(_calls("holders.started")) == 1  # its step was not started again
    assert _calls("holders.shipped") == []
    assert journal(run) == []
    assert "FAILED" not in verify(), verify()


def test_an_external_step_in_doubt_after_the_request_goes_to_an_operator(start_worker, wait):
    """Killed inside an external call after the request: the takeover does not end the
    run canceled over an effect that may have happened; with no reconcile, an operator
    decides, as after any crash, and no further step starts."""
    worker = start_worker("--concurrency", "1")
    run = start_workflow_run("holders.held_charge_then_ship", {})
    _started(worker, wait)
    cancel_workflow_run(run.pk, "stop")
    worker.kill()  # SIGKILL, inside the external call
    other = start_worker("--concurrency", "1")
    done = _ended(other, wait, run)
    assert (done.status, done.error_code) == ("needs_attention", "EFFECT_OUTCOME_UNKNOWN"), (
        describe(run)
    )
    assert ledger_kinds(run)[0] == "dispatched"
    assert len(_calls("holders.started")) == 1
    assert _calls("holders.shipped") == []


def test_a_queued_run_still_ends_at_once():
    run = start_workflow_run("holders.held_then_ship", {})
    canceled = cancel_workflow_run(run.pk, "not wanted")
    assert (canceled.status, canceled.error_code) == ("canceled", "CANCELED")
    assert canceled.cancel_requested_at is None
    assert ledger_kinds(run) == ["canceled"]


@pytest.mark.parametrize("threads", ["1", "2"], ids=["queued-child", "running-child"])
def test_the_children_of_a_running_run_are_asked_or_canceled(start_worker, wait, threads):
    """A running child is asked as its parent is; a queued one ends at once; neither
    starts a step after the request."""
    worker = start_worker("--concurrency", threads)
    parent = start_workflow_run("holders.parent_then_ship", {})
    wait(
        lambda: len(_calls("holders.started")) == int(threads),
        timeout=TIMEOUT,
        message=lambda: f"the steps to start:\n{worker.report()}",
    )
    (child,) = WorkflowRun.objects.filter(parent_id=parent.pk)
    cancel_workflow_run(parent.pk, "stop the family")
    if threads == "1":
        # Queued: ended at once; or claimed ahead by the worker (prefetched, not started):
        # asked, and its claim ends it before its step.
        now = fresh(child)
        assert now.status == "canceled" or now.cancel_requested_at, describe(child)
    else:
        assert fresh(child).status == "running" and fresh(child).cancel_requested_at
        _release(child)
    _release(parent, step=1)
    for run in (parent, child):
        done = _ended(worker, wait, run)
        assert (done.status, done.error_code) == ("canceled", "CANCELED"), describe(run)
    assert len(_calls("holders.started")) == int(threads)  # the queued child never ran
    assert _calls("holders.shipped") == []
    assert "FAILED" not in verify(), verify()


@pytest.mark.django_db(transaction=False)
def test_a_cancel_heard_before_the_execution_starts_is_told_to_it():
    """A run claimed ahead (tracked with no event yet), or not claimed yet, when the
    notification came: its execution's event is set as it starts, and only then."""
    keeper = LeaseKeeper("default")
    early, ahead = uuid.uuid4(), uuid.uuid4()
    keeper.look_now(str(early))  # not held here yet
    keeper.track(ahead, 1, threading.Event())  # claimed ahead: renewed, not executing
    keeper._asked({ahead: keeper._runs[ahead]}, {ahead})  # a tick found it asked
    keeper.look_now("not a run id")  # ignored
    for run_id in (early, ahead):
        asked = threading.Event()
        keeper.track(run_id, 1, threading.Event(), asked=asked)
        assert asked.is_set(), run_id
    again = threading.Event()
    keeper.track(early, 1, threading.Event(), asked=again)  # told once
    assert not again.is_set()
