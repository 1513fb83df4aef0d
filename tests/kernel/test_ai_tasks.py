"""Durable AI tasks: created once per step, run by workers, cancelable with their run."""

from __future__ import annotations

import time

import pytest

from k2b_workflows import cancel_workflow_run, start_workflow_run, wake_workflow_runs_waiting_on
from k2b_workflows.models import (
    AiTask,
    BudgetAccount,
    BudgetCharge,
    JournalEntry,
    WaitRendezvous,
    WorkflowRun,
)
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall
from tests.support.kernel import execute_exactly

pytestmark = pytest.mark.django_db(transaction=True)

APPS = ["fanout"]


def test_ai_task_result_wakes_the_run_and_the_step_succeeds_with_it():
    run = start_workflow_run("fanout.ai", {"request": {"q": "hello"}})

    stats = run_until_idle(app_ids=APPS)

    run.refresh_from_db()
    assert (run.status, run.output) == ("succeeded", {"answer": {"q": "hello"}})
    assert stats["ai_succeeded"] == 1
    task = AiTask.objects.get(run=run)
    assert (task.status, task.seq, task.effect_key) == ("succeeded", 0, f"{run.id}:0")
    assert ProviderCall.objects.filter(action="ai.echo").count() == 1


def test_step_waits_on_its_ai_task_until_a_worker_runs_the_provider():
    run = start_workflow_run("fanout.ai", {"request": "hi"})

    assert execute_exactly(run.id) == "waiting"

    run.refresh_from_db()
    assert (run.status, run.wait_kind, run.wait_key) == ("waiting", "k2b.ai_task", f"{run.id}:0")
    assert AiTask.objects.get(run=run).status == "queued"
    assert not JournalEntry.objects.filter(run=run).exists()


def test_replayed_step_finds_its_ai_task_and_pays_nothing_again():
    run = start_workflow_run("fanout.ai", {"request": "hi"})
    execute_exactly(run.id)

    # A spurious wake: the step runs again before the task is done.
    wake_workflow_runs_waiting_on(app_id="fanout", kind="k2b.ai_task", key=f"{run.id}:0")
    assert execute_exactly(run.id) == "waiting"
    run_until_idle(app_ids=APPS)

    run.refresh_from_db()
    assert run.status == "succeeded"
    assert AiTask.objects.filter(run=run).count() == 1
    assert BudgetAccount.objects.get(root=run).ai_calls == 1
    assert list(BudgetCharge.objects.filter(account_id=run.id).values_list("unit", "amount")) == [
        ("ai_calls", 1)
    ]


def test_failed_provider_fails_the_step_with_ai_task_failed():
    run = start_workflow_run("fanout.ai", {"provider": "fanout.boom", "request": "x"})

    run_until_idle(app_ids=APPS)

    run.refresh_from_db()
    assert (run.status, run.error_code) == ("failed", "AI_TASK_FAILED")
    assert "model overloaded" in AiTask.objects.get(run=run).error_message


def test_cancel_cancels_queued_children_and_their_ai_tasks_at_once():
    root = start_workflow_run("fanout.ai_children", {"n": 3})
    execute_exactly(root.id)
    kids = list(WorkflowRun.objects.filter(parent=root).order_by("child_index"))
    execute_exactly(kids[0].id)
    execute_exactly(kids[1].id)  # two children wait on queued AI tasks, the third is queued
    assert AiTask.objects.filter(status="queued").count() == 2

    cancel_workflow_run(root.id, "customer left")

    assert set(WorkflowRun.objects.filter(root=root).values_list("status", flat=True)) == {
        "canceled"
    }
    assert set(AiTask.objects.values_list("status", flat=True)) == {"canceled"}
    run_until_idle(app_ids=APPS)
    assert not ProviderCall.objects.filter(action="ai.echo").exists()
    assert set(WorkflowRun.objects.filter(root=root).values_list("status", flat=True)) == {
        "canceled"
    }


@pytest.mark.crash
def test_cancel_aborts_a_running_provider_and_discards_its_late_result(start_worker, wait):
    worker = start_worker("--concurrency", "2", "--app", "fanout")
    run = start_workflow_run("fanout.ai", {"provider": "fanout.slow", "request": {"limit_s": 30}})
    wait(
        lambda: (
            ProviderCall.objects.filter(action="ai.slow.started").exists()
            and WorkflowRun.objects.get(pk=run.id).status == "waiting"
        ),
        timeout=30,
        message="the provider to start in the worker while the run waits",
    )
    signals_before = WaitRendezvous.objects.get(kind="k2b.ai_task", key=f"{run.id}:0").signal_seq

    canceled_at = time.time()
    cancel_workflow_run(run.id, "no longer needed")

    stopped = wait(
        lambda: ProviderCall.objects.filter(action="ai.slow.stopped").first(),
        timeout=30,
        message="the provider to stop",
    )
    assert stopped.payload["saw_abort"] is True  # the abort event, not its own 30 s limit
    assert stopped.pid == worker.pid
    wait(lambda: "result discarded" in worker.output(), message="the worker to discard the result")
    task = AiTask.objects.get(run=run)
    assert (task.status, task.result) == ("canceled", None)
    run.refresh_from_db()
    assert (run.status, run.error_code) == ("canceled", "CANCELED")
    assert not JournalEntry.objects.filter(run=run).exists()
    rendezvous = WaitRendezvous.objects.get(kind="k2b.ai_task", key=f"{run.id}:0")
    assert rendezvous.signal_seq == signals_before  # the late result woke nothing
    print(f"provider saw the abort {stopped.payload['seen_at'] - canceled_at:.3f} s after cancel")


@pytest.mark.crash
def test_cancel_sets_ctx_canceled_for_a_running_action_and_its_run_stops_after_it(
    start_worker, wait
):
    """A running run is asked (#49): the action sees ``ctx.canceled`` within a second,
    what it returns is its step's result, and the step after it never starts."""
    worker = start_worker("--concurrency", "1", "--app", "fanout")
    run = start_workflow_run("fanout.linger", {"limit_s": 30})
    wait(
        lambda: ProviderCall.objects.filter(action="linger.started").exists(),
        timeout=30,
        message="the action to start in the worker",
    )

    canceled_at = time.time()
    asked = cancel_workflow_run(run.id, "stop it")
    assert asked.status == "running" and asked.cancel_requested_at is not None

    stopped = wait(
        lambda: ProviderCall.objects.filter(action="linger.stopped").first(),
        timeout=30,
        message="the action to stop",
    )
    assert stopped.payload["saw_cancel"] is True  # ctx.canceled, not its own 30 s limit
    assert stopped.pid == worker.pid
    seen = stopped.payload["seen_at"] - canceled_at
    print(f"action saw ctx.canceled {seen:.3f} s after cancel")
    assert seen < 1.0, seen
    wait(
        lambda: WorkflowRun.objects.get(pk=run.id).status == "canceled",
        timeout=30,
        message=worker.report,
    )
    run.refresh_from_db()
    assert (run.status, run.error_code) == ("canceled", "CANCELED")
    assert run.error_message.startswith("stop it ("), run.error_message
    # Its result was journaled; the echo after it never ran.
    assert [(e.seq, e.output) for e in JournalEntry.objects.filter(run=run)] == [
        (0, {"lingered": True})
    ]
