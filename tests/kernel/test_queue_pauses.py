"""Paused queues (#49): nothing claims a paused queue's runs, and nothing waits on them.

These run the worker's loop in the test's thread (``run_until_idle``); the
fleet-wide promises (a live worker, a restart, the wake-up of a resume) are
in ``tests/worker/test_queue_pause.py``.
"""

from __future__ import annotations

import datetime as dt

import pytest
from django.contrib.admin.models import LogEntry
from django.core.exceptions import PermissionDenied

from k2b_workflows import (
    InvalidInput,
    Schedule,
    pause_queue,
    paused_queues,
    resume_queue,
    schedule_workflow,
    start_workflow_run,
    workflow,
)
from k2b_workflows.kernel import claim, seals
from k2b_workflows.models import QueuePause, WorkflowRun
from k2b_workflows.testing import controlled_clock, run_until_idle
from tests.support.admin import user_with
from tests.support.kernel import fresh

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_paused_queues_runs_are_accepted_queued_and_not_claimed_while_others_run():
    before = start_workflow_run("queues.held", {"n": 1})
    assert pause_queue("held", reason="the mail provider is down") is True
    after = start_workflow_run("queues.held", {"n": 2})
    elsewhere = start_workflow_run("queues.note", {"n": 3})
    stats = run_until_idle(timeout=30)
    assert stats["runs"] == 1, stats
    assert fresh(elsewhere).status == "succeeded"
    assert fresh(before).status == fresh(after).status == "queued"
    assert claim.next_due_in_ms("default") is None, "a paused queue's due run woke the loop"
    assert resume_queue("held") is True
    run_until_idle(timeout=30)
    assert fresh(before).status == fresh(after).status == "succeeded"


def test_a_schedules_ticks_into_a_paused_queue_start_runs_that_wait():
    with controlled_clock() as clock:
        schedule_workflow("held-hourly", "queues.held", Schedule(every=dt.timedelta(hours=1)))
        pause_queue("held", reason="deploy")
        clock.advance(hours=1)
        stats = run_until_idle(timeout=30)
        (run,) = WorkflowRun.objects.filter(schedule_id="held-hourly")
        assert stats["scheduled"] == 1 and (run.queue, run.status) == ("held", "queued")
        resume_queue("held")
        run_until_idle(timeout=30)
        assert fresh(run).status == "succeeded"


def test_paused_queues_says_who_paused_when_and_why_and_the_first_pause_stays():
    assert pause_queue("held", reason="provider outage", actor="deploy-bot") is True
    assert pause_queue("held", reason="another reason", actor="someone else") is False
    (info,) = paused_queues().values()
    assert (info.queue, info.reason, info.paused_by) == ("held", "provider outage", "deploy-bot")
    assert info.paused_at is not None
    assert resume_queue("held") is True
    assert paused_queues() == {}


def test_a_resume_of_a_queue_that_is_not_paused_changes_nothing_and_says_so():
    assert resume_queue("never-paused") is False
    assert not QueuePause.objects.exists()


def test_a_workflows_runs_are_in_its_queue_unless_the_start_names_another():
    declared = start_workflow_run("queues.held", {"n": 1})
    named = start_workflow_run("queues.held", {"n": 2}, queue="urgent")
    plain = start_workflow_run("queues.note", {"n": 3})
    assert (fresh(declared).queue, fresh(named).queue, fresh(plain).queue) == (
        "held",
        "urgent",
        "default",
    )
    # The start seal covers the queue: a run moved to another queue no longer matches.
    assert seals.problem(fresh(named)) is None
    WorkflowRun.objects.filter(pk=named.pk).update(queue="held")
    assert seals.problem(fresh(named)) is not None


BAD_NAMES = [
    ("", "must not be empty"),
    ("   ", "must not be empty"),
    ("q" * 101, "is 101 characters long, at most 100"),
    ("a\x00b", "contains a NUL character"),
    (7, "must be a string"),
]


@pytest.mark.parametrize(("name", "message"), BAD_NAMES)
def test_a_bad_queue_name_is_refused_naming_what_is_wrong(name, message):
    with pytest.raises(InvalidInput, match=f"queue {message}"):
        pause_queue(name, reason="why")
    with pytest.raises(InvalidInput, match=f"queue {message}"):
        resume_queue(name)
    with pytest.raises(InvalidInput, match=f"queue {message}"):
        start_workflow_run("queues.note", {}, queue=name)
    with pytest.raises(InvalidInput, match=f"workflow 'queues.bad': queue {message}"):
        workflow("queues.bad", queue=name)
    assert not QueuePause.objects.exists() and not WorkflowRun.objects.exists()


@pytest.mark.parametrize("reason", ["", "   ", None])
def test_a_pause_without_a_reason_is_refused(reason):
    with pytest.raises(InvalidInput, match="pausing queue 'held' needs a reason"):
        pause_queue("held", reason=reason)
    assert not QueuePause.objects.exists()


def test_a_user_needs_the_permission_and_their_pause_and_resume_are_in_the_admin_history():
    with pytest.raises(PermissionDenied, match=r"k2b_workflows\.pause_queue"):
        pause_queue("held", reason="why", actor=user_with("view_workflowrun", name="viewer"))
    assert not QueuePause.objects.exists()
    operator = user_with("pause_queue")
    assert pause_queue("held", reason="provider outage", actor=operator)
    assert paused_queues()["held"].paused_by == operator.username
    assert resume_queue("held", actor=operator)
    entries = LogEntry.objects.filter(object_id="held").order_by("pk")
    assert [(e.user_id, e.change_message) for e in entries] == [
        (operator.pk, "Paused: provider outage"),
        (operator.pk, "Resumed"),
    ]
