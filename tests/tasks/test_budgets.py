"""Budgets of django.tasks tasks (#37): ``effect_budget`` and ``cost`` on a task.

What they guard: one call of a task never charges more than its budget, whatever
its arguments say. The enqueue refuses a call it can price over budget; the
worker's charge, before the task's function is called, is the guarantee: a call
priced over budget there (the price changed after the enqueue, ``K2B_TEST_PRICE``)
fails with ``EFFECT_BUDGET_EXCEEDED`` and the function is never called (the
"provider", ``ProviderCall``, sees nothing). Real PostgreSQL; the external task's
guarantee with a real worker process.
"""

from __future__ import annotations

import datetime as dt
import signal

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.urls import reverse

from k2b_workflows import Schedule
from k2b_workflows.exceptions import InvalidInput
from k2b_workflows.models import BudgetAccount, BudgetCharge, LedgerEntry, WorkflowRun
from k2b_workflows.tasks import InvalidTaskCall, WorkflowsBackend, enqueue_many, schedule_task
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall
from tests.support import runtime_role
from tests.support.runtime_role import RUNTIME, as_runtime, refused
from tests.tasks_app import tasks as t
from tests.tasks_app.tasks import BUDGET, EXTRA_ARGUMENTS, price

try:
    from django.tasks import TaskResultStatus, task
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskResultStatus, task  # type: ignore[no-redef]

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", RUNTIME])
runtime = runtime_role.runtime

SUCCESSFUL, FAILED = TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED
TIMEOUT = 90  # generous: the machine is shared; nothing here is a timing assertion
needs_extra_arguments = pytest.mark.skipif(
    not EXTRA_ARGUMENTS, reason="Django 6.0's @task takes no effect_budget= or cost="
)


def run(result_id: str) -> WorkflowRun:
    return WorkflowRun.objects.get(pk=result_id)


def calls(action: str) -> list[ProviderCall]:
    return list(ProviderCall.objects.filter(action=action).order_by("id"))


def charges(result_id: str) -> list[tuple[str, int]]:
    return list(BudgetCharge.objects.filter(run_id=result_id).values_list("unit", "amount"))


# -- the guarantee ------------------------------------------------------------------------


def test_a_call_within_its_budget_runs_and_pays_its_cost_to_its_own_budget():
    result = t.budgeted_charge.enqueue("o-1", 20_000)
    account = BudgetAccount.objects.get(root_id=result.id)
    assert account.effect_budget == BUDGET  # written with the run: it is its own root
    run_until_idle()
    assert t.budgeted_charge.get_result(result.id).status == SUCCESSFUL
    assert charges(result.id) == [("cents", 20_000)]
    assert [c.payload["cents"] for c in calls("task.budgeted_charge")] == [20_000]


def test_a_call_the_worker_prices_over_budget_fails_and_is_never_called(monkeypatch):
    """Idempotent: the charge is committed before the call, and refused before it."""
    result = t.budgeted_flaky.enqueue("k", 30_000, 0)
    monkeypatch.setenv("K2B_TEST_PRICE", "30000")  # 60,000 cents on the worker
    run_until_idle()
    assert run(result.id).status == "failed"
    assert run(result.id).error_code == "EFFECT_BUDGET_EXCEEDED"
    assert "50000" in run(result.id).error_message
    assert t.budgeted_flaky.get_result(result.id).status == FAILED
    assert calls("task.budgeted_flaky") == []
    assert charges(result.id) == []


@pytest.mark.crash  # real worker processes
def test_an_external_call_priced_over_budget_by_its_worker_is_never_dispatched(start_worker):
    """A real worker process, its price list changed after the enqueue: the call fails
    with EFFECT_BUDGET_EXCEEDED, no dispatch record, no incident, nothing called."""
    over = t.budgeted_charge.enqueue("o-2", 30_000)
    within = t.budgeted_charge.enqueue("o-3", 10_000)
    worker = start_worker("--burst", "--concurrency", "1", env={"K2B_TEST_PRICE": "30000"})
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()
    failed = run(over.id)
    assert failed.status == "failed", failed.error_message  # not needs_attention
    assert failed.error_code == "EFFECT_BUDGET_EXCEEDED"
    assert t.budgeted_charge.get_result(over.id).status == FAILED
    assert not LedgerEntry.objects.filter(run_id=over.id, kind=LedgerEntry.Kind.DISPATCHED).exists()
    assert charges(over.id) == []
    # The worker went on: 10,000 + 30,000 is within the budget of 50,000.
    assert t.budgeted_charge.get_result(within.id).status == SUCCESSFUL
    assert charges(within.id) == [("cents", 40_000)]
    assert [c.payload["order"] for c in calls("task.budgeted_charge")] == ["o-3"]


@pytest.mark.crash  # real worker processes
def test_a_call_run_again_after_its_worker_was_killed_pays_its_cost_once(start_worker, wait):
    """SIGKILL inside the idempotent task, after its charge committed: the next worker
    calls it again (same effect key) and pays nothing again."""
    result = t.budgeted_flaky.enqueue("k", 30_000, 0, crash="task_budgeted")
    dying = start_worker("--concurrency", "1", env={"K2B_TEST_CRASH": "task_budgeted"})
    assert dying.wait(timeout=TIMEOUT) == -signal.SIGKILL, dying.output()
    healthy = start_worker("--concurrency", "1")
    wait(
        lambda: run(result.id).status in ("succeeded", "failed"),
        timeout=TIMEOUT,
        message=lambda: f"task {result.id} to settle:\n{healthy.report()}",
    )
    assert run(result.id).status == "succeeded", run(result.id).error_message
    seen = calls("task.budgeted_flaky")
    assert len(seen) == 2 and seen[0].pid != seen[1].pid
    assert charges(result.id) == [("cents", 30_000)]


def test_a_retried_call_pays_its_cost_once():
    """30,000 cents on a budget of 50,000: a second charge would fail the third attempt."""
    result = t.budgeted_flaky.enqueue("k", 30_000, 2)
    run_until_idle()
    done = t.budgeted_flaky.get_result(result.id)
    assert done.status == SUCCESSFUL, run(result.id).error_message
    assert done.return_value == {"attempt": 3}
    assert len(calls("task.budgeted_flaky")) == 3
    assert charges(result.id) == [("cents", 30_000)]


@pytest.mark.parametrize(
    ("price_change", "message"),
    [
        ("raise", "LookupError: no price for k"),
        ("exit", "SystemExit: 3"),
        ("garbage", "must be a dict of unit"),
        ("other-unit", "does not limit"),
    ],
)
def test_a_cost_the_worker_cannot_compute_fails_the_call_and_the_worker_goes_on(
    monkeypatch, price_change, message
):
    broken = t.budgeted_flaky.enqueue("k", 1_000, 0)
    fine = t.add.enqueue(1, 2)
    monkeypatch.setenv("K2B_TEST_PRICE", price_change)
    run_until_idle()
    failed = run(broken.id)
    assert failed.status == "failed"
    assert failed.error_code == "INVALID_TASK_COST"
    assert message in failed.error_message and "tests.tasks_app.tasks.price" in failed.error_message
    assert calls("task.budgeted_flaky") == [] and charges(broken.id) == []
    assert t.add.get_result(fine.id).return_value == 3


def test_the_runtime_role_cannot_raise_a_tasks_budget(runtime):
    """The worker checks the budget written with the run: the role it connects as can
    neither raise the account's limit nor make the sealed input say another."""
    result = t.budgeted_charge.enqueue("o-8", 30_000)
    refused(
        """UPDATE k2b_budget_account SET effect_budget = '{"cents": 1000000}' WHERE root_id = %s""",
        [result.id],
    )
    as_runtime(
        """UPDATE k2b_run SET input = jsonb_set(input, '{effect_budget,cents}', '1000000')"""
        " WHERE id = %s",
        [result.id],
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("K2B_TEST_PRICE", "30000")
        run_until_idle()
    tampered = run(result.id)
    assert tampered.status == "needs_attention"  # refused at its claim, loudly
    assert tampered.error_code == "INTEGRITY_CHAIN_BROKEN" and "seal" in tampered.error_message
    assert calls("task.budgeted_charge") == [] and charges(result.id) == []


def test_the_admin_shows_a_task_runs_budget_and_charge(admin_client):
    result = t.budgeted_charge.enqueue("o-4", 12_345)
    run_until_idle()
    response = admin_client.get(reverse("admin:k2b_workflows_workflowrun_change", args=[result.id]))
    html = response.content.decode()
    budget = html[html.index('id="k2b-budget"') :]
    assert "<td>cents</td><td>12345</td><td>50000</td>" in budget
    assert "No charges." not in budget


# -- the enqueue's check --------------------------------------------------------------------


def test_an_enqueue_priced_over_budget_is_refused_before_anything_is_inserted(nothing_inserted):
    with pytest.raises(InvalidTaskCall, match="a cost of 50001 'cents' is over the effect_budget"):
        t.budgeted_charge.enqueue("o-5", 50_001)


def test_an_enqueue_whose_cost_raises_is_refused(monkeypatch, nothing_inserted):
    monkeypatch.setenv("K2B_TEST_PRICE", "raise")
    with pytest.raises(InvalidTaskCall, match="raised LookupError: no price for o-6"):
        t.budgeted_charge.enqueue("o-6", 1)


def test_enqueue_many_checks_each_calls_cost(nothing_inserted):
    with pytest.raises(InvalidTaskCall, match="a cost of 60000 'cents'"):
        enqueue_many(t.budgeted_charge, [(("a", 1), None), (("b", 60_000), None)])


def test_enqueue_many_gives_each_call_its_own_budget():
    results = enqueue_many(t.budgeted_charge, [(("a", 40_000), None), (("b", 40_000), None)])
    run_until_idle()
    assert [t.budgeted_charge.get_result(r.id).status for r in results] == [SUCCESSFUL] * 2
    assert [charges(r.id) for r in results] == [[("cents", 40_000)]] * 2
    assert {
        a.effect_budget["cents"]
        for a in BudgetAccount.objects.filter(root_id__in=[r.id for r in results])
    } == {50_000}


def test_a_schedule_of_a_call_over_budget_is_refused(nothing_inserted):
    with pytest.raises(InvalidTaskCall, match="over the effect_budget"):
        schedule_task(
            "budgeted-nightly",
            t.budgeted_charge,
            Schedule(every=dt.timedelta(days=1)),
            args=("o-7", 90_000),
        )


# -- bad declarations -------------------------------------------------------------------------


@needs_extra_arguments
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"effect_budget": 5, "cost": price}, "effect_budget must be a dict"),
        ({"effect_budget": {"cents": -1}, "cost": price}, "between 0 and"),
        ({"effect_budget": {"cents": True}, "cost": price}, "must be an int"),
        ({"effect_budget": {"": 1}, "cost": price}, "must not be empty"),
        ({"effect_budget": BUDGET}, "an effect_budget without a cost charges nothing"),
        ({"cost": price}, "cost without an effect_budget"),
        ({"effect_budget": BUDGET, "cost": {"cents": 60_000}}, "a cost of 60000 'cents'"),
        ({"effect_budget": BUDGET, "cost": {"cent": 1}}, r"charges \['cent'\] that the"),
        ({"effect_budget": BUDGET, "cost": {"cents": -1}}, "cost must be a dict of unit"),
        ({"effect_budget": BUDGET, "cost": 5}, "cost must be a dict of unit -> int or a"),
        ({"effect_budget": BUDGET, "cost": lambda *a: {}}, "does not import back"),
        ({"effect_budget": BUDGET, "cost": "tests.nowhere.price"}, "does not import here"),
        ({"effect": "pure", "effect_budget": BUDGET, "cost": price}, "a pure task has no effect"),
    ],
    ids=[
        "not-a-dict",
        "negative",
        "bool",
        "empty-unit",
        "budget-alone",
        "cost-alone",
        "fixed-cost-over",
        "unknown-unit",
        "negative-cost",
        "cost-not-a-dict",
        "lambda",
        "cost-path-missing",
        "pure",
    ],
)
def test_a_budget_that_makes_no_sense_is_refused_with_the_task(options, message):
    options = {"effect": "external", **options}
    with pytest.raises(InvalidInput, match=message):
        task(**options)(t.noop.func)


@needs_extra_arguments
def test_a_cost_function_that_is_not_module_level_is_refused():
    def local_price(*args, **kwargs):
        return {"cents": 1}

    with pytest.raises(InvalidTaskCall, match="define it at module level"):
        task(effect="external", effect_budget=BUDGET, cost=local_price)(t.noop.func)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"effect_budget": [1]}, "effect_budget must be a dict"),
        ({"effect_budget": {"cents": -5}, "cost": {"cents": 1}}, "between 0 and"),
        ({"effect_budget": BUDGET}, "an effect_budget without a cost charges nothing"),
        ({"cost": "tests.tasks_app.tasks.price"}, "cost without an effect_budget"),
        ({"effect_budget": BUDGET, "cost": "tests.nowhere.price"}, "does not import here"),
        ({"effect_budget": BUDGET, "cost": "tests.tasks_app.tasks.BUDGET"}, "is not callable"),
        (
            {"effect": "pure", "effect_budget": BUDGET, "cost": {"cents": 1}},
            "a pure task has no effect",
        ),
    ],
    ids=["not-a-dict", "negative", "budget-alone", "cost-alone", "missing", "not-callable", "pure"],
)
def test_a_budget_in_options_that_makes_no_sense_is_an_improperly_configured_backend(
    options, message
):
    with pytest.raises(ImproperlyConfigured, match=message):
        WorkflowsBackend(
            "x", {"BACKEND": "k2b_workflows.tasks.WorkflowsBackend", "OPTIONS": options}
        )


def test_a_budget_in_options_applies_to_the_aliases_tasks():
    """Django 6.0's path: ``OPTIONS`` declares the budget and the cost (a dotted path)."""
    backend = WorkflowsBackend(
        "x",
        {
            "BACKEND": "k2b_workflows.tasks.WorkflowsBackend",
            "OPTIONS": {"effect_budget": BUDGET, "cost": "tests.tasks_app.tasks.price"},
        },
    )
    declared = backend.declared_input(t.charge_default)
    assert declared["effect_budget"] == BUDGET
    assert declared["cost"] == "tests.tasks_app.tasks.price"


@needs_extra_arguments
def test_a_task_with_a_budget_is_hashable_as_any_task():
    fixed = task(effect="external", effect_budget=BUDGET, cost={"cents": 1})(t.noop.func)
    assert hash(fixed) == hash(fixed) and hash(t.budgeted_charge) == hash(t.budgeted_charge)


def test_a_task_without_a_budget_keeps_its_input_as_it_was():
    assert "effect_budget" not in t.add.get_backend().declared_input(t.add)
    assert "cost" not in t.add.get_backend().declared_input(t.add)
