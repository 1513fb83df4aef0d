"""``@workflow(..., timeout=...)``: a run not ended by then is canceled with WORKFLOW_TIMEOUT."""

from __future__ import annotations

import datetime as dt

import pytest

from k2b_workflows import InvalidInput, start_workflow_run, wait_for_workflow_run, workflow
from k2b_workflows.kernel import seals
from k2b_workflows.models import LedgerEntry, WorkflowRun
from k2b_workflows.store import WORKFLOW_TIMEOUT
from k2b_workflows.testing import (
    assert_run_status,
    controlled_clock,
    crash_after_effect,
    run_until_idle,
)
from tests.support.kernel import describe, fresh, journal, ledger_kinds
from tests.workflows.callers import ChargeOnce, calls, recorded
from tests.workflows.waits import open_gate

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_waiting_run_is_canceled_when_its_timeout_passes():
    run = start_workflow_run("callers.timed_gate", {"key": "never"})
    assert fresh(run).timeout_at == fresh(run).created_at + dt.timedelta(hours=1)
    with controlled_clock() as clock:
        run_until_idle(app_ids=["tests"])
        clock.advance(minutes=59)
        run_until_idle(app_ids=["tests"])
        assert fresh(run).status == "waiting"
        clock.advance(minutes=2)
        run_until_idle(app_ids=["tests"])
    assert_run_status(run, "canceled", error_code=WORKFLOW_TIMEOUT)
    assert wait_for_workflow_run(run.pk, timeout=5).error_code == WORKFLOW_TIMEOUT
    assert LedgerEntry.Kind.CANCELED in ledger_kinds(run)
    assert seals.problem(fresh(run)) is None  # the end is sealed with the timeout's code


def test_a_run_that_ends_in_time_is_not_touched():
    run = start_workflow_run("callers.timed_gate", {"key": "soon"})
    with controlled_clock() as clock:
        run_until_idle(app_ids=["tests"])
        open_gate("soon", 1)
        run_until_idle(app_ids=["tests"])
        clock.advance(hours=2)
        run_until_idle(app_ids=["tests"])
    assert_run_status(run, "succeeded")


def test_a_run_needing_an_operator_is_left_to_the_operator():
    run = start_workflow_run("callers.timed_charge", {})
    with controlled_clock() as clock, crash_after_effect(ChargeOnce):
        run_until_idle(app_ids=["tests"])
        assert fresh(run).status == "needs_attention", describe(run)
        clock.advance(hours=2)
        run_until_idle(app_ids=["tests"])
    assert_run_status(run, "needs_attention", error_code="EFFECT_OUTCOME_UNKNOWN")
    assert calls("callers.charge_once") == 1


def test_an_external_step_in_flight_is_canceled_never_rerun_and_its_late_result_kept(
    start_worker, wait
):
    worker = start_worker("--concurrency", "2")
    run = start_workflow_run("callers.timed_external", {})
    wait(lambda: calls("callers.blocks") == 1, timeout=60, message=worker.report)
    # The hour passes for this run: its deadline is moved, not the worker's clock.
    WorkflowRun.objects.filter(pk=run.pk).update(timeout_at=fresh(run).created_at)
    ended = wait_for_workflow_run(run.pk, timeout=60)
    assert (ended.status, ended.error_code) == ("canceled", WORKFLOW_TIMEOUT)
    kinds = wait(
        lambda: LedgerEntry.Kind.LATE_RESULT in (k := ledger_kinds(run)) and k,
        timeout=60,
        message=lambda: f"the late result's evidence\n{describe(run)}\n{worker.report()}",
    )
    assert kinds[0] == LedgerEntry.Kind.DISPATCHED
    assert LedgerEntry.Kind.SUCCEEDED not in kinds  # the late result is evidence only
    assert [e.action_name for e in journal(run)] == ["callers.record"]
    assert calls("callers.blocks") == 1 and recorded("before") == 1
    worker.signal(15)
    assert worker.wait(60) == 0
    assert calls("callers.blocks") == 1


@pytest.mark.parametrize("timeout", [dt.timedelta(0), dt.timedelta(seconds=-1), 30, "1h"])
def test_a_timeout_that_is_not_a_positive_timedelta_is_refused(timeout):
    with pytest.raises(InvalidInput, match="timeout"):
        workflow("callers.bad_timeout", app_id="tests", timeout=timeout)
