"""Effect budgets on the root run: charged once per step before dispatch, never overshot."""

from __future__ import annotations

import pytest
from django.db.models import Sum

from k2b_workflows import start_workflow_run
from k2b_workflows.models import BudgetAccount, BudgetCharge, JournalEntry, WorkflowRun
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall

pytestmark = pytest.mark.django_db(transaction=True)

APPS = ["fanout"]


def charged(root, unit: str) -> int:
    return (
        BudgetCharge.objects.filter(account_id=root.id, unit=unit).aggregate(total=Sum("amount"))[
            "total"
        ]
        or 0
    )


def test_budget_of_three_across_five_children_allows_exactly_three_effects():
    root = start_workflow_run("fanout.budget_3", {"n": 5})

    run_until_idle(app_ids=APPS)

    root.refresh_from_db()
    assert root.status == "succeeded"
    assert sorted(root.output) == ["EFFECT_BUDGET_EXCEEDED"] * 2 + ["succeeded"] * 3
    kids = WorkflowRun.objects.filter(parent=root)
    refused = [k for k in kids if k.error_code == "EFFECT_BUDGET_EXCEEDED"]
    assert len(refused) == 2
    assert {k.status for k in refused} == {"failed"}
    # Refused before any provider call: the provider saw exactly the three charged steps.
    calls = set(
        ProviderCall.objects.filter(action="fanout.send").values_list("effect_key", flat=True)
    )
    assert len(calls) == 3
    assert not calls & {f"{k.id}:0" for k in refused}
    assert charged(root, "sends") == 3
    assert BudgetAccount.objects.get(root=root).spent == {"sends": 3}


def test_step_failing_retryably_after_its_charge_is_not_charged_again():
    root = start_workflow_run("fanout.retry_send", {"fail_times": 2})

    run_until_idle(app_ids=APPS)

    root.refresh_from_db()
    assert root.status == "succeeded"
    assert ProviderCall.objects.filter(action="fanout.send").count() == 3  # two failures, then ok
    # The budget is 1: a second charge would have failed the step with EFFECT_BUDGET_EXCEEDED.
    assert BudgetCharge.objects.filter(account_id=root.id).count() == 1
    assert BudgetAccount.objects.get(root=root).spent == {"sends": 1}


def test_step_without_cost_charges_nothing_but_is_authorized_and_journaled():
    root = start_workflow_run("fanout.note", {})

    run_until_idle(app_ids=APPS)

    root.refresh_from_db()
    assert root.status == "succeeded"
    assert BudgetCharge.objects.filter(account_id=root.id).count() == 0
    assert ProviderCall.objects.filter(action="fanout.note.authorize").count() == 1
    assert JournalEntry.objects.get(run=root, seq=0).action_name == "fanout.note"


def test_step_without_cost_is_still_refused_by_authorize():
    root = start_workflow_run("fanout.note", {"deny": True})

    run_until_idle(app_ids=APPS)

    root.refresh_from_db()
    assert (root.status, root.error_code) == ("failed", "FORBIDDEN")
    assert not ProviderCall.objects.filter(action="fanout.note").exists()


def test_step_refused_by_authorize_spends_no_budget():
    root = start_workflow_run("fanout.guarded_send", {"to": "x", "deny": True})

    run_until_idle(app_ids=APPS)

    root.refresh_from_db()
    assert (root.status, root.error_code) == ("failed", "FORBIDDEN")
    assert not ProviderCall.objects.filter(action="fanout.send").exists()
    assert BudgetCharge.objects.filter(account_id=root.id).count() == 0
    assert BudgetAccount.objects.get(root=root).spent == {}


def test_max_ai_calls_refuses_the_second_ai_task_before_creating_it():
    root = start_workflow_run("fanout.ai_twice", {})

    run_until_idle(app_ids=APPS)

    root.refresh_from_db()
    assert (root.status, root.error_code) == ("failed", "EFFECT_BUDGET_EXCEEDED")
    assert root.ai_tasks.count() == 1
    assert ProviderCall.objects.filter(action="ai.echo").count() == 1
    assert BudgetAccount.objects.get(root=root).ai_calls == 1


@pytest.mark.slow
def test_fifty_children_on_two_worker_processes_never_overshoot_the_budget(start_worker, wait):
    workers = [start_worker("--concurrency", "4", "--app", "fanout") for _ in range(2)]
    for worker in workers:
        wait(lambda w=worker: "thread(s)" in w.output(), message="a worker to start")
    root = start_workflow_run("fanout.budget_20", {"n": 50})

    wait(
        lambda: WorkflowRun.objects.get(pk=root.id).status == "succeeded",
        timeout=120,
        message="the parent of 50 children to succeed",
    )

    root.refresh_from_db()
    assert root.output.count("succeeded") == 20
    assert root.output.count("EFFECT_BUDGET_EXCEEDED") == 30
    assert charged(root, "sends") == 20
    assert ProviderCall.objects.filter(action="fanout.send").count() == 20
    assert BudgetAccount.objects.get(root=root).spent == {"sends": 20}
    # Both processes did part of the work.
    assert ProviderCall.objects.values("pid").distinct().count() == 2
