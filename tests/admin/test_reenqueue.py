"""The operator's "re-enqueue" and the cap on one operation's selection (#49).

Re-enqueue starts a new run beside each selected one, with the same input; a
run whose start seal does not verify (its input rewritten by the runtime role)
is refused, or an operator's click would seal the forgery into a new run.
"""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.core.exceptions import PermissionDenied
from django.test import Client
from django.urls import reverse

from k2b_workflows import InvalidInput, start_workflow_run
from k2b_workflows.admin import views as admin_views
from k2b_workflows.control import reenqueue_workflow_run
from k2b_workflows.models import WorkflowRun
from k2b_workflows.testing import run_until_idle
from tests.support.admin import client_for, make_user, messages_of
from tests.tasks_app import tasks as test_tasks

pytestmark = pytest.mark.django_db(transaction=True)


def post_action(client: Client, action: str, runs: list[WorkflowRun], **extra: str):
    url = reverse("admin:k2b_workflows_workflowrun_changelist")
    data = {"action": action, "_selected_action": [str(r.pk) for r in runs], **extra}
    return client.post(url, data, follow="post" in extra)


@pytest.fixture
def operator():
    return make_user("rita", "view_workflowrun", "retry_workflowrun")


def test_a_failed_task_call_is_re_enqueued_as_a_new_call_with_the_same_arguments(operator):
    result = test_tasks.boom.enqueue("no stock")
    run_until_idle()
    failed = WorkflowRun.objects.get(pk=result.id)
    assert failed.status == "failed"
    client = client_for(operator)
    page = post_action(client, "reenqueue_runs", [failed])
    assert page.context["eligible"] == [failed]
    post_action(client, "reenqueue_runs", [failed], post="yes", reason="stock is back")
    new = WorkflowRun.objects.exclude(pk=failed.pk).get()
    assert (new.status, new.task_path, new.queue) == ("queued", failed.task_path, failed.queue)
    assert new.input == failed.input
    failed.refresh_from_db()
    assert failed.status == "failed", "the original is not touched"
    assert "stock is back" in LogEntry.objects.get(object_id=str(failed.pk)).get_change_message()
    # The new call is a call of the task: the worker runs it (and it fails the same way).
    run_until_idle()
    assert test_tasks.boom.get_result(str(new.pk)).status == "FAILED"


def test_a_workflow_run_is_re_enqueued_on_its_queue_with_its_priority(operator):
    run = start_workflow_run("test.pure", {"a": 1, "b": 2}, queue="batch", priority=7)
    new = reenqueue_workflow_run(run.pk, actor=operator)
    assert new.pk != run.pk
    assert (new.workflow_name, new.input, new.queue, new.priority) == (
        "test.pure",
        {"a": 1, "b": 2},
        "batch",
        7,
    )


def test_a_run_whose_input_was_rewritten_is_not_re_enqueued(operator):
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    # What the runtime role can do: rewrite a queued run's input in place.
    WorkflowRun.objects.filter(pk=run.pk).update(input={"a": 1000, "b": 2})
    with pytest.raises(InvalidInput, match="not the one it was started with"):
        reenqueue_workflow_run(run.pk, actor=operator)
    page = post_action(client_for(operator), "reenqueue_runs", [run])
    assert page.context["eligible"] == []
    assert WorkflowRun.objects.count() == 1


def test_re_enqueue_needs_the_retry_permission():
    viewer = make_user("vera", "view_workflowrun")
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    with pytest.raises(PermissionDenied, match="retry_workflowrun"):
        reenqueue_workflow_run(run.pk, actor=viewer)
    url = reverse("admin:k2b_workflows_workflowrun_changelist")
    assert 'value="reenqueue_runs"' not in client_for(viewer).get(url).content.decode()


def test_a_selection_past_the_cap_is_refused_whole_and_says_how_many(operator, monkeypatch):
    monkeypatch.setattr(admin_views, "MAX_SELECTED", 2)
    runs = [start_workflow_run("test.pure", {"a": i, "b": 1}) for i in range(3)]
    canceller = make_user("carl", "view_workflowrun", "cancel_workflowrun")
    response = post_action(client_for(canceller), "cancel_runs", runs, post="yes", reason="x")
    assert any("3 runs are selected" in m and "at most 2" in m for m in messages_of(response))
    assert set(WorkflowRun.objects.values_list("status", flat=True)) == {"queued"}
    post_action(client_for(canceller), "cancel_runs", runs[:2], post="yes", reason="x")
    assert WorkflowRun.objects.filter(status="canceled").count() == 2
