"""Signals for alerting and metrics, sent once a run's change of state has committed."""

from __future__ import annotations

import pytest

from k2b_workflows import cancel_workflow_run, start_workflow_run
from k2b_workflows.signals import run_finished, run_needs_attention
from k2b_workflows.store import EFFECT_OUTCOME_UNKNOWN, FORBIDDEN
from k2b_workflows.testing import run_until_idle

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def received():
    events: list[tuple[str, dict]] = []

    def on_finished(sender, **kwargs):
        events.append(("finished", {k: v for k, v in kwargs.items() if k != "signal"}))

    def on_attention(sender, **kwargs):
        events.append(("attention", {k: v for k, v in kwargs.items() if k != "signal"}))

    run_finished.connect(on_finished)
    run_needs_attention.connect(on_attention)
    yield events
    run_finished.disconnect(on_finished)
    run_needs_attention.disconnect(on_attention)


def test_an_incident_is_announced_with_its_code_and_step(received):
    run = start_workflow_run("test.charge_blind", {"behaviour": "ambiguous"})
    run_until_idle()
    (event,) = received
    assert event[0] == "attention"
    assert event[1]["run_id"] == run.pk
    assert event[1]["workflow_name"] == "test.charge_blind"
    assert (event[1]["error_code"], event[1]["step"]) == (EFFECT_OUTCOME_UNKNOWN, 0)
    assert "no reconcile()" in event[1]["message"]


def test_runs_that_end_are_announced_once_with_their_status(received):
    ok = start_workflow_run("test.pure", {"a": 1, "b": 2})
    denied = start_workflow_run("test.guarded", {"deny": "raise"})
    flaky = start_workflow_run("test.flaky", {"times": 1})  # a retry is not an ending
    waiting = start_workflow_run("test.wait", {"key": "never"})
    run_until_idle()
    cancel_workflow_run(waiting.pk, "no longer needed")

    ended = {e[1]["run_id"]: (e[1]["status"], e[1]["error_code"]) for e in received}
    assert len(received) == 4
    assert ended == {
        ok.pk: ("succeeded", ""),
        denied.pk: ("failed", FORBIDDEN),
        flaky.pk: ("succeeded", ""),
        waiting.pk: ("canceled", "CANCELED"),
    }


def test_a_receiver_that_raises_does_not_disturb_the_worker(received):
    def broken(sender, **kwargs):
        raise RuntimeError("pager service down")

    run_finished.connect(broken)
    try:
        run = start_workflow_run("test.pure", {"a": 1, "b": 2})
        run_until_idle()
    finally:
        run_finished.disconnect(broken)
    run.refresh_from_db()
    assert run.status == "succeeded"
    assert [e[0] for e in received] == ["finished"]
