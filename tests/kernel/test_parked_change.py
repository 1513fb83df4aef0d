"""A workflow changed under a parked run: a step inserted where the run waits is an incident.

A parked step has no journal entry, so replay had nothing to compare it with:
a step inserted at the parked position ran as a new step (its effect
included) and moved the waiting action one on, under another ``effect_key``,
unflagged. The run row now keeps the parked action's name, and replay stops
the run as ``WORKFLOW_NONDETERMINISTIC`` before the new step runs.
"""

from __future__ import annotations

from typing import Any

import pytest

from k2b_workflows import (
    Action,
    Dependency,
    Effect,
    start_workflow_run,
    succeeded,
    waiting,
    wake_workflow_runs_waiting_on,
    workflow,
)
from k2b_workflows.testing import assert_run_status, run_until_idle
from tests.support.kernel import fresh

pytestmark = pytest.mark.django_db(transaction=True)

#: What the workflow's code looks like in this test's "deploy".
CODE = {"insert": False, "patched": False}
#: Actions called, in order.
CALLS: list[str] = []


class First(Action):
    name = "parked.first"
    effect = Effect.PURE

    def run(self, ctx: Any, input: Any) -> Any:
        CALLS.append(self.name)
        return succeeded({})


class Inserted(Action):
    name = "parked.inserted"
    effect = Effect.PURE

    def run(self, ctx: Any, input: Any) -> Any:
        CALLS.append(self.name)
        return succeeded({})


class WaitForGo(Action):
    name = "parked.wait_for_go"
    effect = Effect.PURE

    def run(self, ctx: Any, input: Any) -> Any:
        CALLS.append(self.name)
        if input.get("go"):
            return succeeded({"went": True})
        return waiting(Dependency("go", input["key"]))


@workflow("parked.change", app_id="parked")
def change(run: Any, input: Any) -> Any:
    run.step(First, {})
    if CODE["insert"] and (not CODE["patched"] or run.patched("insert-step")):
        run.step(Inserted, {})
    return run.step(WaitForGo, {"key": input["key"], "go": CODE.get("go", False)})


@pytest.fixture(autouse=True)
def _old_code():
    CODE.clear()
    CODE.update(insert=False, patched=False)
    CALLS.clear()
    yield
    CODE.clear()
    CODE.update(insert=False, patched=False)


def _park(key: str):
    run = start_workflow_run("parked.change", {"key": key})
    run_until_idle()
    parked = fresh(run)
    assert (parked.status, parked.wait_step, parked.wait_action) == (
        "waiting",
        1,
        "parked.wait_for_go",
    )
    return run


def test_a_step_inserted_where_the_run_is_parked_stops_it_before_the_new_step_runs():
    run = _park("k-1")
    CODE["insert"] = True  # deployed while the run waits
    CALLS.clear()

    wake_workflow_runs_waiting_on(app_id="parked", kind="go", key="k-1")
    run_until_idle()

    assert_run_status(run, "needs_attention", error_code="WORKFLOW_NONDETERMINISTIC")
    assert CALLS == []  # neither the inserted step nor the moved wait ran
    stopped = fresh(run)
    assert "step 1 was 'parked.wait_for_go' when the run parked there, now 'parked.inserted'" in (
        stopped.error_message
    )
    assert stopped.error_detail["parked"] == {"action": "parked.wait_for_go"}


def test_the_insertion_behind_a_patch_keeps_the_parked_run_on_the_old_order():
    run = _park("k-2")
    CODE.update(insert=True, patched=True, go=True)
    CALLS.clear()

    wake_workflow_runs_waiting_on(app_id="parked", kind="go", key="k-2")
    run_until_idle()

    assert_run_status(run, "succeeded")
    assert CALLS == ["parked.wait_for_go"]  # no inserted step for the run that had parked
    new = start_workflow_run("parked.change", {"key": "k-3"})
    CALLS.clear()
    run_until_idle()
    assert_run_status(new, "succeeded")
    assert CALLS == ["parked.first", "parked.inserted", "parked.wait_for_go"]


def test_a_woken_run_on_unchanged_code_continues():
    run = _park("k-4")
    CODE["go"] = True
    wake_workflow_runs_waiting_on(app_id="parked", kind="go", key="k-4")
    run_until_idle()
    assert_run_status(run, "succeeded")
