"""Deterministic replay: journaled steps are not re-run; a changed workflow is an incident."""

from __future__ import annotations

import pytest

from k2b_workflows import start_workflow_run, wake_workflow_runs_waiting_on
from k2b_workflows.store import WORKFLOW_NONDETERMINISTIC
from tests.models import DomainRow, ProviderCall
from tests.support.kernel import describe, fresh, journal, run_to_end

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_journaled_step_is_not_run_again_when_a_later_step_retries():
    run = start_workflow_run("kernel.replay", {"times": 2})
    stats = run_to_end()
    assert fresh(run).status == "succeeded"
    assert stats["runs"] == 3  # two retries replayed step 0 from the journal
    assert ProviderCall.objects.filter(action="kernel.record").count() == 1
    assert ProviderCall.objects.filter(action="test.flaky").count() == 3
    assert fresh(run).output == {"n": 1}


def test_replay_returns_the_journaled_output():
    run = start_workflow_run("kernel.replay", {"times": 1})
    run_to_end()
    first, _ = journal(run)
    assert first.output == {"n": 1}
    assert fresh(run).output == first.output


def test_a_different_action_at_a_journaled_position_needs_attention():
    run = start_workflow_run("test.nondeterministic", {})
    run_to_end()
    assert fresh(run).status == "waiting"
    DomainRow.objects.create(key="switch")  # the workflow now picks another first action
    wake_workflow_runs_waiting_on(app_id="tests", kind="signal", key="never")
    run_to_end()
    state = describe(run)
    assert (state["status"], state["code"]) == ("needs_attention", WORKFLOW_NONDETERMINISTIC)
    assert "test.add" in state["message"] and "test.flaky" in state["message"]
    assert ProviderCall.objects.filter(action="test.flaky").count() == 0
    assert [e.action_name for e in journal(run)] == ["test.add"]


def test_workflow_code_catching_exception_cannot_swallow_a_park():
    run = start_workflow_run("kernel.swallow", {"key": "later"})
    run_to_end()
    parked = fresh(run)
    assert parked.status == "waiting"
    assert parked.output is None
    DomainRow.objects.create(key="later")
    wake_workflow_runs_waiting_on(app_id="tests", kind="signal", key="later")
    run_to_end()
    assert fresh(run).output == {"swallowed": False}


def test_registering_a_workflow_name_again_warns_and_the_latest_wins():
    from k2b_workflows import workflow
    from k2b_workflows.workflows import get_workflow

    @workflow("test.registered_twice", app_id="tests")
    def first(run, input):
        return 1

    with pytest.warns(RuntimeWarning, match="test.registered_twice"):

        @workflow("test.registered_twice", app_id="tests")
        def second(run, input):
            return 2

    assert get_workflow("test.registered_twice").fn is second
