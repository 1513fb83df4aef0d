"""The incident box, the resolve form and the incident queue show the call (#51): its
arguments, redacted as inputs are, and an effect key only where the code could use one."""

from __future__ import annotations

import pytest
from django.urls import reverse

from k2b_workflows import start_workflow_run
from k2b_workflows.models import LedgerEntry, WorkflowRun
from k2b_workflows.testing import crash_after_effect, run_until_idle
from tests.support.admin import client_for, make_user, resolve_url, run_url
from tests.tasks_app import tasks as t

pytestmark = pytest.mark.django_db(transaction=True)

KEY_NOTE = "what the provider knows this effect by"


def task_incident(task, *args):
    with crash_after_effect(task):
        result = task.enqueue(*args)
        run_until_idle()
    run = WorkflowRun.objects.get(pk=result.id)
    assert run.status == "needs_attention", run.error_message
    return run


def effect_key_of(run) -> str:
    return LedgerEntry.objects.get(run=run, kind="dispatched").effect_key


@pytest.fixture
def root():
    return client_for(make_user("root", superuser=True))


def test_the_incident_box_and_the_form_show_the_calls_input_redacted(root):
    run = start_workflow_run(
        "test.charge_blind", {"behaviour": "ambiguous", "customer": "c-41", "password": "s3cret"}
    )
    run_until_idle()
    for url in (run_url(run), resolve_url(run)):
        html = root.get(url).content.decode()
        assert "Called with" in html and "c-41" in html
        assert "s3cret" not in html
    # A workflow action is given its effect key in its step context: shown, as before.
    html = root.get(resolve_url(run)).content.decode()
    assert f"<code>{effect_key_of(run)}</code>" in html and KEY_NOTE in html


def test_a_keyless_tasks_form_shows_its_arguments_and_no_effect_key(root):
    run = task_incident(t.charge_keyless, "o-9")
    html = root.get(resolve_url(run)).content.decode()
    assert "o-9" in html
    assert f"<code>{effect_key_of(run)}</code>" not in html and KEY_NOTE not in html
    assert "this task takes no context" in html


def test_a_task_that_can_read_its_effect_key_shows_it_as_what_it_may_have_passed(root):
    run = task_incident(t.charge, "o-10")
    html = root.get(resolve_url(run)).content.decode()
    assert f"<code>{effect_key_of(run)}</code>" in html
    assert "what effect_key(context) returned to the task" in html
    assert KEY_NOTE not in html


def test_the_incident_queue_shows_each_calls_arguments(root):
    run = task_incident(t.charge_keyless, {"order": "o-11", "token": "tok_secret"})
    html = root.get(reverse("admin:k2b_workflows_incident_changelist")).content.decode()
    assert "called with" in html.lower()
    assert "o-11" in html and "tok_secret" not in html
    assert str(run.pk)[:8] in html
