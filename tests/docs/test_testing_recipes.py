"""The recipes of docs/testing.md, run as they are shown there (the page includes this file).

They test the demo shop's checkout (example_project/demo), the way a team
would test its own workflows.
"""

from __future__ import annotations

# --8<-- [start:imports]
import pytest

from example_project.demo.models import OutboxEmail, Payment
from example_project.demo.workflows import ChargeCard, SendReceipt
from k2b_workflows import start_workflow_run
from k2b_workflows.models import WorkflowRun
from k2b_workflows.testing import (
    assert_effect_once,
    assert_run_status,
    crash_after_effect,
    describe_run,
    fast_retries,
    run_until_idle,
)

# Your root conftest.py says this once (here: for the k2b_clock recipe below).
pytest_plugins = ["k2b_workflows.pytest_plugin"]

ORDER = {"sku": "TEA-01", "items": ["teapot"], "amount_cents": 2_900, "customer": "a@example.com"}
# Steps are numbered from 0 in the order the workflow calls run.step:
# 0 create the order, 1 wait for approval, 2 charge the card, ...
CHARGE_STEP = 2
# --8<-- [end:imports]


# --8<-- [start:happy_path]
@pytest.mark.django_db(transaction=True)
def test_checkout_succeeds_and_charges_once():
    run = start_workflow_run("shop.checkout", ORDER)

    run_until_idle()

    assert_run_status(run, "succeeded")
    assert_effect_once(run, step=CHARGE_STEP)
    assert Payment.objects.count() == 1


# --8<-- [end:happy_path]


# --8<-- [start:crash_after_charge]
@pytest.mark.django_db(transaction=True)
def test_a_crash_after_the_charge_is_reconciled_not_charged_again():
    with crash_after_effect(ChargeCard) as lost_results, fast_retries():
        run = start_workflow_run("shop.checkout", ORDER)
        run_until_idle()

    assert len(lost_results) == 1  # the card was charged, then the worker "died"
    assert_run_status(run, "succeeded")
    assert_effect_once(run, step=CHARGE_STEP)  # reconcile() found it: one dispatch
    assert Payment.objects.count() == 1


# --8<-- [end:crash_after_charge]


# --8<-- [start:crash_after_idempotent]
@pytest.mark.django_db(transaction=True)
def test_a_crash_after_the_receipt_sends_it_again_under_the_same_key():
    with crash_after_effect(SendReceipt), fast_retries():
        run = start_workflow_run("shop.checkout", ORDER)
        run_until_idle()

    assert_run_status(run, "succeeded")
    assert OutboxEmail.objects.count() == 1  # the outbox deduplicated the second send


# --8<-- [end:crash_after_idempotent]


# --8<-- [start:incident]
@pytest.mark.django_db(transaction=True)
def test_a_payout_the_bank_cannot_confirm_goes_to_an_operator():
    run = start_workflow_run("shop.payout", {"amount_cents": 12_500})

    run_until_idle()

    assert_run_status(run, "needs_attention", error_code="EFFECT_OUTCOME_UNKNOWN")


# --8<-- [end:incident]


# --8<-- [start:approval_deadline]
@pytest.mark.django_db(transaction=True)
def test_an_order_nobody_approves_is_looked_at_again_after_a_day(k2b_clock):
    run = start_workflow_run("shop.checkout", {**ORDER, "amount_cents": 90_000})
    run_until_idle()
    assert_run_status(run, "waiting")  # for a manager, with a deadline a day away
    deadline = WorkflowRun.objects.get(pk=run.pk).wait_deadline

    k2b_clock.advance(hours=23)
    run_until_idle()
    assert WorkflowRun.objects.get(pk=run.pk).wait_deadline == deadline  # not yet

    k2b_clock.advance(hours=1)
    run_until_idle()  # past the deadline: the step looked again, and waits another day
    assert WorkflowRun.objects.get(pk=run.pk).wait_deadline > deadline


# --8<-- [end:approval_deadline]


@pytest.mark.django_db(transaction=True)
def test_assert_run_status_shows_the_journal_and_ledger_when_it_fails():
    run = start_workflow_run("shop.payout", {"amount_cents": 12_500})
    run_until_idle()

    with pytest.raises(AssertionError) as failure:
        assert_run_status(run, "succeeded")

    message = str(failure.value)
    assert "expected succeeded" in message
    assert "needs_attention EFFECT_OUTCOME_UNKNOWN" in message
    assert "step 0 dispatched shop.bank_payout" in message
    assert message.endswith(describe_run(run).splitlines()[-1])


@pytest.mark.django_db(transaction=True)
def test_assert_effect_once_fails_when_a_step_was_dispatched_twice():
    # Without reconcile() doubt ends in an incident; an operator's "absent"
    # makes the kernel dispatch the step again: two dispatches of one step.
    from django.contrib.auth import get_user_model

    from k2b_workflows import EFFECT_ABSENT, resolve_effect

    run = start_workflow_run("shop.payout", {"amount_cents": 12_500})
    run_until_idle()
    operator = get_user_model().objects.create_superuser("op", "op@example.com", "pw")
    resolve_effect(run.pk, EFFECT_ABSENT, evidence="bank statement: no transfer", actor=operator)
    run_until_idle()

    with pytest.raises(AssertionError, match="dispatched 2 time"):
        assert_effect_once(run, step=0)


@pytest.mark.django_db(transaction=True)
def test_crash_after_effect_restores_the_action_and_crashes_only_as_often_as_asked():
    original = ChargeCard.__dict__["run"]
    with crash_after_effect(ChargeCard, times=1) as lost, fast_retries():
        first = start_workflow_run("shop.checkout", ORDER)
        run_until_idle()
        second = start_workflow_run("shop.checkout", {**ORDER, "customer": "b@example.com"})
        run_until_idle()
    assert ChargeCard.__dict__["run"] is original
    assert len(lost) == 1
    assert_run_status(first, "succeeded")
    assert_run_status(second, "succeeded")
    assert Payment.objects.count() == 2


# --8<-- [start:tasks]
from docs.examples.providers import gateway  # noqa: E402  (a provider's test double)
from k2b_workflows import failed, succeeded  # noqa: E402
from k2b_workflows.tasks import effect_key  # noqa: E402

try:
    from django.tasks import TaskResultStatus, task
except ImportError:  # Django 5.2 with the django-tasks backport
    from django_tasks import TaskResultStatus, task


# Your tasks, at module level (here, in the test module itself).
@task(effect="pure")
def total(order_id, lines):
    return {"order": order_id, "total": sum(line["amount"] for line in lines)}


def find_charge(context, order_id, amount):
    made = gateway.find(idempotency_key=effect_key(context))
    return succeeded({"charge": made.id}) if made else failed("not found", retryable=True)


@task(takes_context=True, effect="external", reconcile=find_charge)
def charge_once(context, order_id, amount):
    return {"charge": gateway.charge(amount, idempotency_key=effect_key(context)).id}


@pytest.mark.django_db(transaction=True)
def test_a_task_runs_to_its_result():
    result = total.enqueue("o-1", [{"amount": 1_200}, {"amount": 300}])

    run_until_idle()  # what a worker would do, in this process, until nothing is due

    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == {"order": "o-1", "total": 1_500}


@pytest.mark.django_db(transaction=True)
def test_a_charge_cut_by_a_crash_is_settled_by_its_reconcile():
    gateway.reset()
    with crash_after_effect(charge_once) as lost_results:
        result = charge_once.enqueue("o-2", 2_900)
        run_until_idle()

    assert len(lost_results) == 1  # charged, then the worker "died" before recording it
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL  # find_charge() found it
    assert len(gateway.charges) == 1
    assert result.attempts == 1  # the function was called once


# --8<-- [end:tasks]
