"""``manage.py workflowruns``: operators see runs, and what each waiting run waits for."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from k2b_workflows import start_workflow_run
from k2b_workflows.models import WorkflowRun
from k2b_workflows.testing import run_until_idle

pytestmark = pytest.mark.django_db(transaction=True)


def workflowruns(*args: str) -> str:
    out = StringIO()
    call_command("workflowruns", *args, stdout=out)
    return out.getvalue()


def test_waiting_lists_kind_key_deadline_and_since_of_each_waiting_run():
    run = start_workflow_run("waits.gate", {"key": "invoice-7", "deadline_s": 3600})
    done = start_workflow_run("test.pure", {"a": 1, "b": 1})
    run_until_idle(app_ids=["tests"])
    run = WorkflowRun.objects.get(pk=run.pk)

    lines = workflowruns("--waiting").splitlines()

    assert lines[0].split() == [
        "RUN",
        "APP",
        "WORKFLOW",
        "STEP",
        "KIND",
        "KEY",
        "DEADLINE",
        "WAITING",
        "SINCE",
        "FOR",
    ]
    [row] = [line for line in lines[2:] if str(run.pk) in line]
    assert "gate" in row.split() and "invoice-7" in row.split()
    assert timezone.localtime(run.wait_deadline).strftime("%Y-%m-%d %H:%M:%S") in row
    assert timezone.localtime(run.waiting_since).strftime("%Y-%m-%d %H:%M:%S") in row
    assert str(done.pk) not in "\n".join(lines)


def test_status_and_app_filters_select_runs():
    waiting_run = start_workflow_run("waits.gate", {"key": "filtered"})
    done = start_workflow_run("test.pure", {"a": 1, "b": 1})
    run_until_idle(app_ids=["tests"])

    succeeded = workflowruns("--status", "succeeded")
    assert str(done.pk) in succeeded and str(waiting_run.pk) not in succeeded
    assert workflowruns("--app", "no-such-app").strip() == "no runs"


def test_waiting_refuses_another_status():
    with pytest.raises(CommandError):
        workflowruns("--waiting", "--status", "queued")
