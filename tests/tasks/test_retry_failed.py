"""An operator retries a FAILED task call (#51): one more attempt of the same call, its
attempts counted on, from the admin and from ``manage.py workflowrun retry`` alike, both
saying so in the same words. (A workflow run that failed on a journaled step is still
refused: tests/kernel/test_control.py.)"""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.urls import reverse

from k2b_workflows import control
from k2b_workflows.models import LedgerEntry, WorkflowRun
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall
from tests.support.admin import client_for, make_user
from tests.tasks_app import tasks as t

try:
    from django.tasks import TaskResultStatus
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskResultStatus  # type: ignore[no-redef]

pytestmark = pytest.mark.django_db(transaction=True)


def failed_call(task, *args):
    result = task.enqueue(*args)
    run_until_idle()
    assert WorkflowRun.objects.get(pk=result.id).error_code == "TASK_FAILED"
    return result


def test_a_failed_task_call_retried_is_called_once_more_and_its_attempts_go_on():
    result = failed_call(t.charge_fails_first, "o-1")
    operator = make_user("root", superuser=True)
    run = control.retry_workflow_run(result.id, actor=operator, reason="provider is back")
    assert run.status == "queued"
    run_until_idle()

    settled = t.charge_fails_first.get_result(result.id)
    assert settled.status == TaskResultStatus.SUCCESSFUL
    assert settled.return_value == {"charged": "o-1"}
    assert settled.attempts == 2  # the failed call, then this one
    assert [e.exception_class_path for e in settled.errors] == ["builtins.RuntimeError"]
    assert ProviderCall.objects.filter(action="task.charge_fails_first").count() == 2
    (retried,) = LedgerEntry.objects.filter(run_id=result.id, kind="retried")
    assert retried.actor == "root" and retried.detail == {"failed_step": 0}


@pytest.mark.parametrize(
    "task",
    [t.fails_its_first_attempt, t.external_fails_its_first_attempt],
    ids=["pure", "external"],
)
def test_the_retried_call_sees_its_attempt_number_go_on(task):
    result = failed_call(task)
    control.retry_workflow_run(result.id, actor=make_user("root", superuser=True), reason="go")
    run_until_idle()
    settled = task.get_result(result.id)
    assert settled.status == TaskResultStatus.SUCCESSFUL
    assert settled.return_value == 2  # context.attempt inside the retried call
    assert settled.attempts == 2


def test_a_call_that_fails_again_is_failed_again_and_can_be_retried_again():
    result = failed_call(t.boom, "no luck")
    operator = make_user("root", superuser=True)
    for retries in (1, 2):
        control.retry_workflow_run(result.id, actor=operator, reason="try again")
        run_until_idle()
        settled = t.boom.get_result(result.id)
        assert settled.status == TaskResultStatus.FAILED
        assert settled.attempts == 1 + retries
        assert len(settled.errors) == 1 + retries
    assert ProviderCall.objects.filter(action="task.boom").count() == 3


def test_the_admin_and_the_command_retry_a_failed_task_and_say_so_in_the_same_words():
    by_admin = failed_call(t.boom, "a")
    by_command = failed_call(t.boom, "b")
    operator = make_user("root", superuser=True)
    client = client_for(operator)

    url = reverse("admin:k2b_workflows_workflowrun_retry", args=[by_admin.id])
    page = client.get(url).content.decode()
    assert "one more attempt of the same call" in page  # offered, not refused
    response = client.post(url, {"post": "yes", "reason": "fixed"}, follow=True)
    said_by_admin = [str(m) for m in response.context["messages"]]

    out = io.StringIO()
    call_command(
        "workflowrun",
        "retry",
        str(by_command.id),
        "--actor",
        "root",
        "--reason",
        "fixed",
        stdout=out,
    )
    words = control.retry_words(WorkflowRun.objects.get(pk=by_admin.id))
    assert words in said_by_admin
    assert out.getvalue().strip() == control.retry_words(WorkflowRun.objects.get(pk=by_command.id))
    assert "one more attempt of the same call" in words


def test_a_retried_idempotent_call_sends_the_provider_the_key_of_its_first_call():
    """One call, one effect key, whoever retries it: the provider that took the failed
    call's request answers the retry with what it did, rather than doing it again."""
    result = failed_call(t.keyed_fails_first, "o-7")
    control.retry_workflow_run(result.id, actor=make_user("root", superuser=True), reason="go")
    run_until_idle()
    assert t.keyed_fails_first.get_result(result.id).status == TaskResultStatus.SUCCESSFUL
    keys = list(
        ProviderCall.objects.filter(action="task.keyed_fails_first")
        .order_by("id")
        .values_list("effect_key", flat=True)
    )
    assert keys == [f"{result.id}:0", f"{result.id}:0"]
