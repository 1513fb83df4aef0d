"""``tasks.cancel`` and ``is_cancel_requested`` (#49), under real workers.

A call not started never runs; a running call is asked, not cut: it reads the
request within a second, a normal return is its result, an error ends it
canceled and it is never tried again, not after a retry policy, not after a
crash. An async pure call gets ``CancelledError``; an external one is never cut.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import pytest

from k2b_workflows import RunCanceled
from k2b_workflows.exceptions import InvalidInput
from k2b_workflows.models import WorkflowRun
from k2b_workflows.tasks import TaskCallNotFound, cancel, is_cancel_requested
from k2b_workflows.tasks.compat import TaskResultDoesNotExist
from tests.models import ProviderCall
from tests.support.misuse import verify
from tests.tasks_app import held as h
from tests.tasks_app import tasks as t

try:
    from django.tasks import TaskContext, TaskResultStatus
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskContext, TaskResultStatus  # type: ignore[no-redef]

TIMEOUT = 90  # generous: the machine is shared; only the ask's latency is measured
CANCELED_ERROR = f"{RunCanceled.__module__}.{RunCanceled.__qualname__}"


def _calls(action: str, key: str) -> int:
    return ProviderCall.objects.filter(action=action, effect_key=key).count()


def _started(worker, wait, key: str) -> None:
    wait(
        lambda: _calls("held.started", key),
        timeout=TIMEOUT,
        message=lambda: f"the call {key} to start:\n{worker.report()}",
    )


def _ended(worker, wait, result) -> WorkflowRun:
    wait(
        lambda: WorkflowRun.objects.get(pk=result.id).status in ("succeeded", "failed", "canceled"),
        timeout=TIMEOUT,
        message=lambda: f"the call {result.id} to end:\n{worker.report()}",
    )
    return WorkflowRun.objects.get(pk=result.id)


@pytest.mark.django_db(transaction=True)
def test_a_ready_call_never_runs_and_fails_as_canceled():
    result = t.add.enqueue(1, 2)
    canceled = cancel(result, "not wanted any more")
    assert canceled.id == result.id
    assert canceled.status == TaskResultStatus.FAILED
    assert canceled.errors[-1].exception_class_path == CANCELED_ERROR
    assert "not wanted any more" in canceled.errors[-1].traceback
    run = WorkflowRun.objects.get(pk=result.id)
    assert (run.status, run.error_code) == ("canceled", "CANCELED")
    from k2b_workflows.testing import run_until_idle

    run_until_idle()
    assert WorkflowRun.objects.get(pk=result.id).status == "canceled"
    # Canceled again, or by id: the ended call is returned unchanged.
    again = cancel(result.id, "twice")
    assert again.status == TaskResultStatus.FAILED
    assert again.finished_at == canceled.finished_at
    assert WorkflowRun.objects.get(pk=result.id).error_message == "not wanted any more"
    assert "FAILED" not in verify(), verify()


@pytest.mark.django_db(transaction=True)
def test_a_finished_call_is_returned_unchanged():
    from k2b_workflows.testing import run_until_idle

    result = t.add.enqueue(20, 22)
    run_until_idle()
    assert cancel(result.id).return_value == 42
    assert WorkflowRun.objects.get(pk=result.id).status == "succeeded"


@pytest.mark.django_db(transaction=True)
def test_cancel_of_an_unknown_or_malformed_id_names_it():
    missing = uuid.uuid4()
    with pytest.raises(TaskCallNotFound, match=str(missing)) as caught:
        cancel(missing)
    assert isinstance(caught.value, TaskResultDoesNotExist)
    assert caught.value.result_id == missing
    with pytest.raises(TaskResultDoesNotExist, match="not-an-id"):
        cancel("not-an-id")
    with pytest.raises(InvalidInput, match="reason"):
        cancel(missing, reason=7)  # type: ignore[arg-type]


@pytest.mark.django_db(transaction=True)
def test_cancel_refuses_a_workflow_run_and_says_what_cancels_it():
    from k2b_workflows import start_workflow_run

    run = start_workflow_run("test.pure", {})
    with pytest.raises(TaskCallNotFound, match="cancel_workflow_run"):
        cancel(run.id)
    assert WorkflowRun.objects.get(pk=run.id).status == "queued"


def test_is_cancel_requested_refuses_what_is_not_a_task_context():
    with pytest.raises(InvalidInput, match="takes_context=True"):
        is_cancel_requested(object())


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_running_call_is_asked_within_a_second_and_its_return_is_its_result(start_worker, wait):
    worker = start_worker("--concurrency", "1")
    result = h.polling.enqueue("poll-1")
    _started(worker, wait, "poll-1")
    asked = time.time()
    now = cancel(result, "stop polling")
    assert now.status == TaskResultStatus.RUNNING  # asked, not ended
    seen = wait(
        lambda: ProviderCall.objects.filter(action="held.asked", effect_key="poll-1").first(),
        timeout=TIMEOUT,
        message=lambda: f"the call to see the request:\n{worker.report()}",
    )
    latency = seen.payload["at"] - asked
    print(f"cancel seen by the running call after {latency * 1000:.0f} ms")
    assert latency < 1.0, latency
    run = _ended(worker, wait, result)
    assert run.status == "succeeded", worker.report()
    assert h.polling.get_result(result.id).return_value == {"stopped": "poll-1"}
    assert _calls("held.started", "poll-1") == 1
    assert "FAILED" not in verify(), verify()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_running_call_that_ignores_the_request_and_returns_succeeds(start_worker, wait):
    worker = start_worker("--concurrency", "1")
    result = h.held.enqueue("ignore-1")
    _started(worker, wait, "ignore-1")
    cancel(result.id, "too late")
    h.release("ignore-1")
    run = _ended(worker, wait, result)
    assert run.status == "succeeded", worker.report()
    assert h.held.get_result(result.id).return_value == {"held": "ignore-1"}


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("task", [h.held_then_raises, h.held_then_fails], ids=["retried", "not"])
def test_a_call_that_raises_after_the_request_fails_as_canceled_and_is_never_retried(
    start_worker, wait, task
):
    key = f"raise-{task.name}"
    # Polling only: no notification tells the keeper of the request before the call
    # raises; only the worker's own read of the row can.
    worker = start_worker("--concurrency", "1", "--no-listen")
    result = task.enqueue(key)
    _started(worker, wait, key)
    cancel(result, "stop")
    # Released at once: the call raises before the worker's keeper may have seen the
    # request; the worker reads it then, and the run ends in this claim.
    h.release(key)
    run = _ended(worker, wait, result)
    assert (run.status, run.error_code) == ("canceled", "CANCELED"), worker.report()
    assert run.error_message.startswith("stop ("), run.error_message
    assert "ValueError" in run.error_message, run.error_message
    assert run.consecutive_failures == 0  # no retry was queued
    # ``held_then_raises``'s policy allows three attempts: one was made.
    following = t.add.enqueue(1, 1)
    wait(
        lambda: WorkflowRun.objects.get(pk=following.id).status == "succeeded",
        timeout=TIMEOUT,
        message=lambda: worker.report(),
    )
    assert _calls("held.started", key) == 1
    final = task.get_result(result.id)
    assert final.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in final.errors] == ["builtins.ValueError", CANCELED_ERROR]
    assert "FAILED" not in verify(), verify()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_async_pure_call_gets_cancelled_error_at_its_next_await(start_worker, wait):
    worker = start_worker("--concurrency", "1")
    result = h.held_async.enqueue("async-1")
    _started(worker, wait, "async-1")
    cancel(result, "stop awaiting")
    run = _ended(worker, wait, result)
    assert (run.status, run.error_code) == ("canceled", "CANCELED"), worker.report()
    assert _calls("held.cancelled", "async-1") == 1
    assert _calls("held.started", "async-1") == 1
    errors = h.held_async.get_result(result.id).errors
    assert [e.exception_class_path for e in errors] == [
        "asyncio.exceptions.CancelledError",
        CANCELED_ERROR,
    ]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_async_external_call_is_asked_and_never_cut(start_worker, wait):
    worker = start_worker("--concurrency", "1")
    result = h.held_charge_async.enqueue("ext-async-1")
    _started(worker, wait, "ext-async-1")
    cancel(result, "stop charging")
    wait(
        lambda: _calls("held.asked", "ext-async-1"),
        timeout=TIMEOUT,
        message=lambda: f"the call to see the request:\n{worker.report()}",
    )
    h.release("ext-async-1")
    run = _ended(worker, wait, result)
    assert run.status == "succeeded", worker.report()
    assert _calls("held.cancelled", "ext-async-1") == 0
    assert _calls("held.charged", "ext-async-1") == 1


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_call_whose_worker_is_killed_after_the_request_is_not_run_again(start_worker, wait):
    worker = start_worker("--concurrency", "1")
    result = h.held.enqueue("crash-1")
    _started(worker, wait, "crash-1")
    cancel(result, "stop")
    worker.kill()  # SIGKILL, inside the call
    other = start_worker("--concurrency", "1")
    h.release("crash-1")
    run = _ended(other, wait, result)
    assert (run.status, run.error_code) == ("canceled", "CANCELED"), other.report()
    assert _calls("held.started", "crash-1") == 1
    assert "FAILED" not in verify(), verify()


@pytest.mark.django_db(transaction=True)
def test_is_cancel_requested_outside_a_worker_reads_the_run():
    result = t.add.enqueue(1, 2)
    context = TaskContext(task_result=result)
    assert is_cancel_requested(context) is False
    cancel(result)
    assert is_cancel_requested(context) is True


# -- the admin's "Cancel selected task calls" --------------------------------------------


def _action(client, runs, **extra):
    from django.urls import reverse

    url = reverse("admin:k2b_workflows_workflowrun_changelist")
    data = {
        "action": "cancel_calls",
        "_selected_action": [str(r.pk) for r in runs],
        "index": "0",
        **extra,
    }
    return client.post(url, data, follow=True)


@pytest.mark.django_db(transaction=True)
def test_the_admin_cancels_task_calls_after_a_confirmation_and_logs_it():
    from django.contrib.admin.models import LogEntry

    from k2b_workflows import start_workflow_run
    from tests.support.admin import client_for, make_user

    client = client_for(make_user("carl", "view_workflowrun", "cancel_workflowrun"))
    call = WorkflowRun.objects.get(pk=t.add.enqueue(1, 2).id)
    workflow_run = start_workflow_run("test.pure", {})
    page = _action(client, [call, workflow_run])
    assert page.context["eligible"] == [call]
    assert "not a task call" in page.content.decode()
    assert "Yes, cancel" in page.content.decode()
    assert WorkflowRun.objects.get(pk=call.pk).status == "queued"
    _action(client, [call, workflow_run], post="yes", reason="customer withdrew")
    run = WorkflowRun.objects.get(pk=call.pk)
    assert (run.status, run.error_code) == ("canceled", "CANCELED")
    assert run.error_message == "customer withdrew (by carl)"
    assert WorkflowRun.objects.get(pk=workflow_run.pk).status == "queued"
    assert "customer withdrew" in LogEntry.objects.get(object_id=str(call.pk)).get_change_message()


@pytest.mark.django_db(transaction=True)
def test_the_admin_refuses_to_cancel_more_task_calls_than_its_cap(monkeypatch):
    from k2b_workflows.admin import views
    from k2b_workflows.tasks import enqueue_many
    from tests.support.admin import client_for, make_user

    monkeypatch.setattr(
        views,
        "OPERATIONS",
        {
            **views.OPERATIONS,
            "cancel_call": dataclasses.replace(views.OPERATIONS["cancel_call"], cap=2),
        },
    )
    client = client_for(make_user("carl", "view_workflowrun", "cancel_workflowrun"))
    results = enqueue_many(t.add, [((i, i), None) for i in range(3)])
    runs = list(WorkflowRun.objects.filter(pk__in=[r.id for r in results]))
    page = _action(client, runs, post="yes", reason="all of them")
    assert "more than 2 runs selected; nothing was done" in page.content.decode()
    assert set(
        WorkflowRun.objects.filter(pk__in=[r.pk for r in runs]).values_list("status", flat=True)
    ) == {"queued"}
