"""Durable timers: ``run.sleep`` and ``run.sleep_until`` park the run, journaled, on our clock."""

from __future__ import annotations

import datetime as dt
import signal

import pytest
from django.utils import timezone

from k2b_workflows import start_workflow_run, wake_workflow_runs_waiting_on
from k2b_workflows.kernel.timers import TIMER_KIND
from k2b_workflows.models import JournalEntry, WorkflowRun
from k2b_workflows.testing import assert_run_status, controlled_clock, run_until_idle
from tests.support.kernel import describe, fresh
from tests.workflows.callers import calls, recorded

pytestmark = pytest.mark.django_db(transaction=True)


def actions(run: WorkflowRun) -> list[str]:
    return list(
        JournalEntry.objects.filter(run=run).order_by("seq").values_list("action_name", flat=True)
    )


def test_a_sleep_parks_the_run_until_the_clock_passes_it_then_goes_on():
    run = start_workflow_run("callers.sleeper", {"seconds": 3600})
    with controlled_clock() as clock:
        run_until_idle(app_ids=["tests"])
        parked = fresh(run)
        assert parked.status == "waiting", describe(run)
        assert parked.wait_kind == TIMER_KIND
        assert parked.wait_deadline - clock.now() > dt.timedelta(minutes=59)
        clock.advance(minutes=59)
        run_until_idle(app_ids=["tests"])
        assert fresh(run).status == "waiting"  # not yet
        clock.advance(minutes=2)
        run_until_idle(app_ids=["tests"])
    assert_run_status(run, "succeeded")
    assert (recorded("before"), recorded("after")) == (1, 1)
    assert actions(run) == ["callers.record", TIMER_KIND, "callers.record"]


def test_a_replay_after_the_sleep_does_not_sleep_again():
    # The step after the sleep fails once: its retry replays the journaled timer.
    run = start_workflow_run("callers.sleeper", {"seconds": 3600, "flaky_at": 2})
    with controlled_clock() as clock:
        run_until_idle(app_ids=["tests"])
        clock.advance(hours=1, seconds=1)
        offset = clock.offset
        run_until_idle(app_ids=["tests"])  # waits out the retry's backoff, not another hour
        assert clock.offset - offset < dt.timedelta(minutes=1)
    assert_run_status(run, "succeeded")
    assert calls("callers.flaky") == 2
    assert actions(run) == ["callers.record", TIMER_KIND, "callers.flaky", "callers.record"]


def test_a_run_woken_before_its_timer_parks_again_for_the_same_instant():
    run = start_workflow_run("callers.sleeper", {"seconds": 3600})
    with controlled_clock() as clock:
        run_until_idle(app_ids=["tests"])
        first = fresh(run)
        clock.advance(minutes=30)
        woken = wake_workflow_runs_waiting_on(app_id="tests", kind=TIMER_KIND, key=first.wait_key)
        assert woken == 1
        run_until_idle(app_ids=["tests"])
        again = fresh(run)
        assert again.status == "waiting"
        assert again.wait_deadline == first.wait_deadline  # not 30 minutes later
        clock.advance_to(first.wait_deadline)
        run_until_idle(app_ids=["tests"])
    assert_run_status(run, "succeeded")
    assert recorded("before") == 1


def test_sleep_until_an_instant_passed_returns_at_once_and_a_future_one_parks():
    past = (timezone.now() - dt.timedelta(days=1)).isoformat()
    run = start_workflow_run("callers.sleeper", {"until": past})
    run_until_idle(app_ids=["tests"])
    assert_run_status(run, "succeeded")

    when = timezone.now() + dt.timedelta(days=2)
    later = start_workflow_run("callers.sleeper", {"until": when.isoformat()})
    with controlled_clock() as clock:
        run_until_idle(app_ids=["tests"])
        assert fresh(later).wait_deadline == when
        clock.advance_to(when)
        run_until_idle(app_ids=["tests"])
    assert_run_status(later, "succeeded")


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("naive", "needs an aware datetime"),
        ("zero", "duration must be positive"),
        ("number", "takes a timedelta"),
    ],
)
def test_a_bad_sleep_is_a_clear_error_in_the_workflow_code(kind, says):
    run = start_workflow_run("callers.bad_sleep", {"kind": kind})
    run_until_idle(app_ids=["tests"])
    ended = fresh(run)
    assert (ended.status, ended.error_code) == ("needs_attention", "WORKFLOW_CODE_ERROR")
    assert says in ended.error_message


@pytest.mark.crash
def test_sigkill_while_a_run_sleeps_changes_nothing_and_holds_no_thread(start_worker, wait):
    run = start_workflow_run("callers.sleeper", {"seconds": 3})
    first = start_worker("--concurrency", "1")
    wait(lambda: fresh(run).status == "waiting", timeout=60, message=first.report)
    first.kill()
    assert first.proc.returncode == -signal.SIGKILL

    second = start_worker("--concurrency", "1")
    other = start_workflow_run("test.pure", {"a": 1, "b": 2})
    wait(lambda: fresh(run).status == "succeeded", timeout=90, message=second.report)
    # The one thread ran another run while this one slept.
    assert fresh(other).status == "succeeded"
    assert fresh(other).finished_at < fresh(run).finished_at
    assert (recorded("before"), recorded("after")) == (1, 1)
    assert actions(run) == ["callers.record", TIMER_KIND, "callers.record"]
    slept = fresh(run).finished_at - fresh(run).created_at
    assert slept >= dt.timedelta(seconds=3)


def test_run_until_idle_waiting_for_deadlines_moves_the_clock_through_a_sleep():
    run = start_workflow_run("callers.sleeper", {"seconds": 7 * 86_400})
    with controlled_clock() as clock:
        run_until_idle(app_ids=["tests"], wait_for_deadlines=True)
        assert clock.offset > dt.timedelta(days=6, hours=23)
    assert_run_status(run, "succeeded")
