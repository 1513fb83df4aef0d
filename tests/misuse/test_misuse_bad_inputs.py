"""Each bad input a review tried and got a traceback, a 500 or silence for (#30).

Every one now gets a clear error naming the field, and loses nothing.
"""

from __future__ import annotations

import datetime as dt
import io

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse

from k2b_workflows import (
    Action,
    Dependency,
    Effect,
    InvalidInput,
    start_workflow_run,
    succeeded,
    waiting,
    workflow,
)
from k2b_workflows.models import JournalEntry, WorkflowRun
from k2b_workflows.store import INVALID_ACTION_RESULT, INVALID_WORKFLOW_OUTPUT
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall
from tests.support.admin import client_for, make_user

HUGE = 10**5000


class WaitForAges(Action):
    name = "bad_inputs.wait_for_ages"
    effect = Effect.PURE

    def run(self, ctx, input):
        ProviderCall.objects.create(action=self.name, effect_key=ctx.effect_key)
        return waiting(Dependency("signal", "never", deadline=dt.timedelta(days=999_999_999)))


class Echo(Action):
    name = "bad_inputs.echo"
    effect = Effect.PURE

    def run(self, ctx, input):
        return succeeded({"n": 1})


@workflow("bad_inputs.wait_for_ages", app_id="bad_inputs")
def _wait_for_ages(run, input):
    return run.step(WaitForAges, {})


@workflow("bad_inputs.huge_output", app_id="bad_inputs")
def _huge_output(run, input):
    run.step(Echo, {})
    return {"n": HUGE}


@pytest.mark.django_db(transaction=True)
def test_a_5000_digit_integer_in_the_input_is_refused_naming_it():
    with pytest.raises(InvalidInput, match=r"the workflow input\['amount'\].*4000 digits"):
        start_workflow_run("test.pure", {"amount": HUGE})
    assert not WorkflowRun.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_workflow_returning_a_5000_digit_integer_fails_once_with_its_code():
    run = start_workflow_run("bad_inputs.huge_output", {})
    run_until_idle(app_ids=["bad_inputs"])
    run.refresh_from_db()
    assert (run.status, run.error_code) == ("failed", INVALID_WORKFLOW_OUTPUT)
    assert "4000 digits" in run.error_message
    assert run.consecutive_failures == 0  # not retried as if the worker had crashed


@pytest.mark.django_db(transaction=True)
def test_a_wait_deadline_past_a_century_is_an_invalid_result_not_retried():
    run = start_workflow_run("bad_inputs.wait_for_ages", {})
    run_until_idle(app_ids=["bad_inputs"])
    run.refresh_from_db()
    assert (run.status, run.error_code) == ("failed", INVALID_ACTION_RESULT)
    assert "deadline" in run.error_message and "36525 days" in run.error_message
    assert ProviderCall.objects.filter(action=WaitForAges.name).count() == 1
    assert JournalEntry.objects.filter(run=run, state="failed").exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "argv, field",
    [
        (["verifyworkflows", "--batch", "100000000000000000000"], "--batch"),
        (["verifyworkflows", "--batch", "1e20"], "--batch"),
        (["verifyworkflows", "--database", "nope"], "--database 'nope'"),
        (["runworkflows", "--health-file", "/nonexistent/x", "--burst"], "--health-file"),
        (["runworkflows", "--wait-for-db", "nan", "--burst"], "--wait-for-db"),
        (["runworkflows", "--wait-for-db", "inf", "--burst"], "--wait-for-db"),
        (["workerhealth", "/tmp/k2b-health", "--max-age", "nan"], "--max-age"),
        (["workerhealth", "/tmp/k2b-health", "--max-age", "inf"], "--max-age"),
    ],
)
def test_bad_command_arguments_are_named_errors(argv, field):
    with pytest.raises(CommandError, match=field):
        call_command(*argv, stdout=io.StringIO(), stderr=io.StringIO())


@pytest.mark.django_db
def test_a_nul_in_a_worker_page_id_is_not_a_server_error():
    client = client_for(make_user("root", superuser=True))
    url = reverse("admin:k2b_workflows_workerrecord_change", args=["w\x00x"])
    response = client.get(url, follow=True)
    assert response.status_code == 200  # the admin's "does not exist" message, on the list
