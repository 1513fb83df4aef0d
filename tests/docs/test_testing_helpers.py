"""``run_until_idle`` in users' own tests, including pytest-django's default transactional tests."""

from __future__ import annotations

import pytest

from k2b_workflows import start_workflow_run, wake_workflow_runs_waiting_on
from k2b_workflows.models import WorkflowRun
from k2b_workflows.testing import run_until_idle
from tests.models import DomainRow


def _statuses(runs: list[WorkflowRun]) -> dict[str, str]:
    return {r.workflow_name: WorkflowRun.objects.get(pk=r.pk).status for r in runs}


@pytest.mark.django_db  # one transaction around the whole test, rolled back at the end
def test_run_until_idle_works_inside_the_tests_own_transaction():
    runs = [
        start_workflow_run("test.pure", {"a": 1, "b": 2}),
        start_workflow_run("test.tx", {"key": "k"}),
        start_workflow_run("test.idem", {"to": "x"}),
        start_workflow_run("test.charge", {"amount": 1, "behaviour": "raise"}),
        start_workflow_run("test.flaky", {"times": 2}),
        start_workflow_run("test.wait", {"key": "w"}),
    ]

    run_until_idle(timeout=30)

    assert _statuses(runs) == {
        "test.pure": "succeeded",
        "test.tx": "succeeded",
        "test.idem": "succeeded",
        "test.charge": "succeeded",
        "test.flaky": "succeeded",
        "test.wait": "waiting",
    }
    DomainRow.objects.create(key="w", value=5)
    wake_workflow_runs_waiting_on(app_id="tests", kind="signal", key="w")
    run_until_idle(timeout=30)
    assert WorkflowRun.objects.get(pk=runs[-1].pk).output == {"got": 5}


@pytest.mark.django_db(transaction=True)
def test_run_until_idle_returns_counts_of_what_it_did():
    start_workflow_run("test.pure", {"a": 1, "b": 2})
    start_workflow_run("test.flaky", {"times": 1})

    stats = run_until_idle(timeout=30)

    assert stats["succeeded"] == 2
    assert stats["retry"] == 1
    assert stats["runs"] == 3
