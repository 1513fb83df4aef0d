"""The Failures page: failed runs grouped by exception class or code and hour (#49)."""

from __future__ import annotations

import pytest
from django.urls import reverse

from k2b_workflows import cancel_workflow_run, failures, start_workflow_run
from k2b_workflows.models import TaskAttempt
from k2b_workflows.testing import run_until_idle
from tests.support.admin import client_for, make_user
from tests.tasks_app import tasks as test_tasks

pytestmark = pytest.mark.django_db(transaction=True)

URL = "admin:k2b_workflows_failures"


@pytest.fixture
def viewer():
    return make_user("vera", "view_workflowrun")


def test_failed_task_calls_are_grouped_by_their_exception_class_and_link_to_their_runs(viewer):
    results = [test_tasks.boom.enqueue(f"no stock {i}") for i in range(3)]
    test_tasks.external_boom.enqueue("provider down")
    test_tasks.add.enqueue(1, 2)
    run_until_idle()
    read = failures.read()
    by_kind = {(g.task_path, g.kind): g.count for g in read.groups}
    assert by_kind == {
        (test_tasks.boom.module_path, "builtins.ValueError"): 3,
        (test_tasks.external_boom.module_path, "builtins.RuntimeError"): 1,
    }
    client = client_for(viewer)
    page = client.get(reverse(URL))
    assert page.status_code == 200
    row = next(r for r in page.context["rows"] if r["group"].kind == "builtins.ValueError")
    listed = client.get(row["url"])
    assert listed.status_code == 200, "the link's lookups are allowed"
    shown = {str(r.pk) for r in listed.context["cl"].result_list}
    assert shown == {str(r.id) for r in results}


def test_a_workflow_run_is_grouped_by_its_error_code_and_a_canceled_run_is_not(settings):
    settings.K2B_WORKFLOWS = {
        **settings.K2B_WORKFLOWS,
        "RUN_MAX_CONSECUTIVE_FAILURES": 1,
        "RETRY_BACKOFF_MS": 1,
    }
    start_workflow_run("test.flaky", {"times": 100})
    canceled = start_workflow_run("test.pure", {"a": 1, "b": 2})
    cancel_workflow_run(canceled.pk, "not a failure")
    run_until_idle()
    assert [(g.workflow_name, g.kind, g.is_exception, g.count) for g in failures.read().groups] == [
        ("test.flaky", "WORKFLOW_RETRY_EXHAUSTED", False, 1)
    ]


def test_an_attempt_row_the_runtime_role_inserted_is_not_counted(viewer):
    result = test_tasks.boom.enqueue("no stock")
    run_until_idle()
    genuine = TaskAttempt.objects.get(run_id=result.id)
    # An unsealed row of a later attempt, naming another exception.
    TaskAttempt.objects.create(
        run_id=result.id,
        attempt=genuine.attempt + 1,
        started_at=genuine.started_at,
        finished_at=genuine.finished_at,
        exception_class_path="forged.Error",
    )
    assert [g.kind for g in failures.read().groups] == ["builtins.ValueError"]


def test_the_page_counts_at_most_the_cap_and_says_so(viewer, monkeypatch):
    monkeypatch.setattr(failures, "SCAN_CAP", 2)
    for i in range(3):
        test_tasks.boom.enqueue(f"x {i}")
    run_until_idle()
    read = failures.read()
    assert read.capped and read.scanned == 2
    assert sum(g.count for g in read.groups) == 2
    page = client_for(viewer).get(reverse(URL))
    assert "only the newest 2 are counted" in page.content.decode()


def test_the_page_needs_the_view_permission_and_takes_a_bad_window():
    nobody = make_user("nemo")
    assert client_for(nobody).get(reverse(URL)).status_code == 403
    viewer = make_user("vera", "view_workflowrun")
    page = client_for(viewer).get(reverse(URL) + "?hours=abc")
    assert page.status_code == 200 and page.context["hours"] == failures.DEFAULT_HOURS
    page = client_for(viewer).get(reverse(URL) + "?hours=100000")
    assert page.context["hours"] == failures.MAX_HOURS
