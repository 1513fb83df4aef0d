"""Signals for alerting and metrics, sent once a run's change of state has committed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import k2b_workflows
from k2b_workflows import cancel_workflow_run, start_workflow_run
from k2b_workflows.signals import run_finished, run_needs_attention
from k2b_workflows.store import CONCURRENCY_LIMITED, EFFECT_OUTCOME_UNKNOWN, FORBIDDEN
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


def test_a_run_born_canceled_by_its_limit_is_told_as_every_end_is(received, caplog):
    """Every way a run ends goes through ``kernel/ended.py`` (#48): a start beyond its
    key's limit (``cancel_newest``) used to be witnessed but never announced, so a
    ``task_finished`` receiver never heard of a task its limit canceled."""
    caplog.set_level(logging.INFO, logger="k2b_workflows.witness")
    start_workflow_run("flow.first_wins", {"key": "b", "nap": 0}, concurrency_key="b")
    born = start_workflow_run("flow.first_wins", {"key": "b", "nap": 0}, concurrency_key="b")
    assert received == [
        (
            "finished",
            {
                "run_id": born.pk,
                "workflow_name": "flow.first_wins",
                "status": "canceled",
                "error_code": CONCURRENCY_LIMITED,
            },
        )
    ]
    (line,) = [r.getMessage() for r in caplog.records if str(born.pk) in r.getMessage()]
    assert '"kind": "end"' in line and '"status": "canceled"' in line


def test_every_end_is_sealed_and_told_in_one_module():
    """No path seals, witnesses or announces a run's end by itself: the next wave's ends
    (fork, batches) have one function to call, and cannot drift from the others."""
    package = Path(k2b_workflows.__file__).parent
    homes = {"kernel/ended.py", "kernel/seals.py", "kernel/witness.py", "signals.py"}
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).as_posix()
        if where in homes:
            continue
        text = path.read_text()
        for needle in (
            "witness.ended(",
            "seals.end_seal(",
            "run_finished,",
            "run_needs_attention,",
        ):
            if needle in text:
                found.append(f"{where}: {needle}")
    assert found == []
