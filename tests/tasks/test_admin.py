"""django.tasks task runs in the admin (#37): their task path, arguments (redacted as
inputs are), failed attempts, errors and return value, on the runs' own screens."""

from __future__ import annotations

import pytest
from django.urls import reverse

from k2b_workflows.testing import run_until_idle
from tests.tasks_app import tasks as t

pytestmark = pytest.mark.django_db(transaction=True)


def page(admin_client, result_id: str) -> str:
    response = admin_client.get(reverse("admin:k2b_workflows_workflowrun_change", args=[result_id]))
    assert response.status_code == 200
    return response.content.decode()


def test_the_runs_list_shows_each_tasks_path(admin_client):
    t.add.enqueue(1, 2)
    response = admin_client.get(reverse("admin:k2b_workflows_workflowrun_changelist"))
    assert response.status_code == 200
    assert "tests.tasks_app.tasks.add" in response.content.decode()


def test_a_failed_task_shows_its_arguments_redacted_its_attempt_and_its_error(admin_client):
    result = t.boom.enqueue("password=hunter2 and more")
    t.mail.enqueue({"to": "a@example.com", "password": "s3cret"})
    run_until_idle()
    html = page(admin_client, result.id)
    assert "tests.tasks_app.tasks.boom" in html
    assert "#1 on" in html and "builtins.ValueError" in html
    assert "Traceback" in html
    assert "hunter2" not in html


def test_a_tasks_arguments_are_redacted_as_inputs_are(admin_client):
    result = t.mail.enqueue({"to": "a@example.com", "password": "s3cret"})
    html = page(admin_client, result.id)
    assert "a@example.com" in html
    assert "s3cret" not in html


def test_a_successful_task_shows_its_return_value(admin_client):
    result = t.add.enqueue(20, 22)
    run_until_idle()
    html = page(admin_client, result.id)
    assert "return value" in html.lower() and "42" in html
    assert "failed attempts" in html.lower()
