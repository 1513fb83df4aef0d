"""The docs' examples run: each page's code (docs/examples/*.py) does what its page says.

The pages include these modules section by section (pymdownx.snippets), so a
test here runs the code a reader sees. Each test loads its modules alone in the
registries (``tests.support.doc_blocks.examples``), drives the runs with ``run_until_idle``
on PostgreSQL and checks the outcome the prose claims. ``RUN_BY`` says which
test runs which module; tests/docs/test_docs.py fails on a module nobody runs.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import logging.config
import re
import shlex
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import transaction

import k2b_workflows
from k2b_workflows import (
    EFFECT_CONFIRMED,
    Action,
    Effect,
    IdempotencyConflict,
    count_child_workflow_runs,
    dry_run,
    resolve_effect,
    start_workflow_run,
    succeeded,
    wake_workflow_runs_waiting_on,
    workflows,
)
from k2b_workflows.models import (
    AiTask,
    BudgetCharge,
    DedupRecord,
    JournalEntry,
    LedgerEntry,
    WorkflowRun,
)
from k2b_workflows.testing import (
    assert_effect_once,
    assert_run_status,
    controlled_clock,
    crash_after_effect,
    fast_retries,
    run_until_idle,
)
from tests.support.doc_blocks import ROOT, block, examples
from tests.support.workflow_steps import one_step

pytestmark = pytest.mark.django_db(transaction=True)

#: docs/examples module -> the tests that run it (tests/docs/test_docs.py checks both ways).
RUN_BY = {
    "callers": [
        "test_the_follow_up_sleeps_three_days_on_the_clock_and_sends_twice",
        "test_an_unsubscribed_address_fails_at_once_despite_the_patient_policy",
        "test_the_views_answer_with_the_result_of_the_run",
    ],
    "callers_views": ["test_the_views_answer_with_the_result_of_the_run"],
    "getting_started": [
        "test_the_getting_started_test_passes_and_the_card_is_charged_once",
        "test_a_crash_after_the_charge_is_reconciled_by_key",
        "test_a_charge_the_gateway_never_made_fails_the_step_with_the_code_of_reconcile",
        "test_starting_a_run_is_idempotent_by_key_and_joins_the_transaction",
        "test_the_dryrun_command_of_getting_started_shows_the_plan",
        "test_a_dry_run_of_every_example_workflow_is_ok",
    ],
    "getting_started_tests": ["test_the_getting_started_test_passes_and_the_card_is_charged_once"],
    "effects": [
        "test_a_transactional_write_commits_once_across_a_crash",
        "test_an_idempotent_email_is_sent_again_under_the_same_key_after_a_crash",
        "test_the_dedup_table_keeps_the_sms_from_going_out_twice",
        "test_a_worker_whose_lease_was_taken_commits_no_fenced_write",
        "test_a_charge_reconciled_absent_is_sent_again_under_its_key_and_made_once",
    ],
    "waits": ["test_the_approval_view_wakes_the_waiting_run", "test_the_wake_of_testing_md_runs"],
    "waits_wake": ["test_the_approval_view_wakes_the_waiting_run"],
    "waits_deadline": [
        "test_an_approval_nobody_gives_in_24_hours_expires_at_the_deadline",
        "test_an_approval_given_before_the_deadline_is_not_expired",
    ],
    "waits_polling": ["test_a_pending_payout_is_polled_until_the_bank_answers"],
    "fan_out": ["test_the_checkout_ships_each_item_in_a_child_run"],
    "budgets": ["test_the_report_budget_allows_100_emails_and_refuses_the_101st"],
    "forks": ["test_a_failed_import_forked_after_the_fix_fetches_nothing_again"],
    "ai_tasks": ["test_the_ai_task_asks_the_provider_once_and_the_step_gets_its_answer"],
    "dry_runs": ["test_the_dry_run_example_prints_the_plan_of_the_checkout"],
    "changing_code_actions": ["test_versions_run_side_by_side_each_run_on_its_own"],
    "changing_code_versions": [
        "test_versions_run_side_by_side_each_run_on_its_own",
        "test_removing_a_patch_while_runs_carry_its_marker_is_nondeterministic",
    ],
    "changing_code_patch": [
        "test_a_patch_takes_the_new_branch_only_where_the_run_had_not_passed_it",
        "test_a_deprecated_patch_replays_runs_that_took_it_and_marks_no_new_run",
        "test_removing_a_patch_while_runs_carry_its_marker_is_nondeterministic",
    ],
    "changing_code_deprecated": [
        "test_a_deprecated_patch_replays_runs_that_took_it_and_marks_no_new_run"
    ],
    "operators_signals": ["test_the_receiver_pages_with_a_link_to_the_resolution_form"],
    "logging_json": ["test_the_json_formatter_writes_one_object_per_line_with_the_run_fields"],
    "public_api": ["test_the_reference_imports_every_public_name"],
    "flow_control": [
        "test_one_sync_per_tenant_runs_at_a_time_and_paid_tenants_go_first",
        "test_a_newer_deploy_cancels_the_one_in_progress",
        "test_the_completion_counts_each_dispatch_against_its_api_key",
        "test_exports_wait_in_their_paused_queue_and_run_once_it_is_resumed",
    ],
    "tutorial": ["test_the_tutorial_approval_wakes_the_demo_checkout"],
    "schedules": ["test_the_nightly_report_fires_at_three_in_berlin_and_the_digest_hourly"],
    "schedules_tests": ["test_the_nightly_report_fires_at_three_in_berlin_and_the_digest_hourly"],
    "tracing": ["test_the_tracing_example_puts_the_run_in_the_requests_trace"],
    "tasks": [
        "test_the_tasks_example_charges_once_and_enqueues_nothing_when_the_order_fails",
        "test_the_tasks_example_invoices_many_and_schedules_one",
        "test_the_tasks_example_rebuilds_a_site_once_and_syncs_the_last_edit",
        "test_the_tasks_example_serves_a_small_tenant_beside_a_large_ones_backlog",
        "test_the_tasks_example_pays_out_within_its_budget_and_refuses_more",
        "test_the_tasks_example_reconcile_finds_the_charge_or_says_call_again",
        "test_the_tasks_example_backoff_spaces_attempts_and_stops_at_a_refusal",
        "test_the_tasks_example_reports_how_far_it_got",
    ],
}


def journal_actions(run: Any) -> list[str]:
    return list(
        JournalEntry.objects.filter(run_id=run.pk)
        .order_by("seq")
        .values_list("action_name", flat=True)
    )


def ledger_kinds(run: Any) -> list[str]:
    return list(
        LedgerEntry.objects.filter(run_id=run.pk).order_by("id").values_list("kind", flat=True)
    )


def refreshed(run: Any) -> Any:
    run.refresh_from_db()
    return run


def superuser() -> Any:
    return get_user_model().objects.create_superuser("ops", "ops@example.com", "x")


# -- docs/getting-started.md ---------------------------------------------------------------


def test_the_getting_started_test_passes_and_the_card_is_charged_once():
    with examples("getting_started", "getting_started_tests") as (_, page_test):
        from docs.examples.models import Order
        from docs.examples.providers import gateway

        page_test.test_checkout_charges_once()  # the page's own test, as shown

        (run,) = WorkflowRun.objects.filter(workflow_name="shop.checkout")
        assert journal_actions(run) == ["shop.create_order", "shop.charge_card"]
        assert run.output == {"order": Order.objects.get().pk, "charge": "ch_1"}
        assert list(gateway.charges) == [f"{run.pk}:1"]  # charged once, by the step's key
        assert_effect_once(run, step=1)
        assert BudgetCharge.objects.filter(run=run, unit="charges").count() == 1


def test_a_crash_after_the_charge_is_reconciled_by_key():
    with examples("getting_started") as (shop,):
        from docs.examples.providers import gateway

        with crash_after_effect(shop.ChargeCard) as lost, fast_retries():
            run = start_workflow_run("shop.checkout", {"sku": "TEA-01", "amount": 2900})
            run_until_idle()

        assert len(lost) == 1
        assert_run_status(run, "succeeded")
        # run() was called once; reconcile() found the charge by ctx.effect_key.
        assert gateway.calls == [f"{run.pk}:1"]
        assert_effect_once(run, step=1)
        assert "reconciled" in ledger_kinds(run)
        assert refreshed(run).output["charge"] == "ch_1"


def test_a_charge_the_gateway_never_made_fails_the_step_with_the_code_of_reconcile(monkeypatch):
    with examples("getting_started") as _:
        from docs.examples.providers import gateway

        def lost_connection(amount: int, *, idempotency_key: str) -> Any:
            gateway.calls.append(idempotency_key)
            raise ConnectionError("reset before the gateway got the request")

        monkeypatch.setattr(gateway, "charge", lost_connection)
        run = start_workflow_run("shop.checkout", {"sku": "TEA-01", "amount": 2900})
        run_until_idle()

        # After dispatch an exception is an unknown outcome: reconcile() asks the
        # gateway, which has no charge, and the step fails with its code; never re-run.
        assert_run_status(run, "failed", error_code="CHARGE_ABSENT")
        assert len(gateway.calls) == 1
        assert ledger_kinds(run).count("dispatched") == 1


def test_starting_a_run_is_idempotent_by_key_and_joins_the_transaction():
    with examples("getting_started") as (shop,):
        request = SimpleNamespace(user=SimpleNamespace(pk=7))
        cart = SimpleNamespace(pk=12)
        run = shop.start_checkout(request, cart)
        assert shop.start_checkout(request, cart).pk == run.pk
        assert run.principal == {"user": 7}
        with pytest.raises(IdempotencyConflict, match=str(run.pk)):
            start_workflow_run(
                "shop.checkout",
                {"sku": "X", "amount": 1},
                idempotency_key="checkout-12",
                principal={"user": 7},
            )
        # Another principal's key: refused, and neither the run nor its owner is told.
        with pytest.raises(IdempotencyConflict, match="another principal") as caught:
            start_workflow_run(
                "shop.checkout", run.input, idempotency_key="checkout-12", principal={"user": 8}
            )
        assert caught.value.run_id is None and str(run.pk) not in str(caught.value)

        class RolledBack(Exception):
            pass

        with pytest.raises(RolledBack), transaction.atomic():
            shop.start_checkout(request, SimpleNamespace(pk=13))
            raise RolledBack
        assert not WorkflowRun.objects.filter(idempotency_key="checkout-13").exists()


def test_the_dryrun_command_of_getting_started_shows_the_plan():
    text = (ROOT / "docs" / "getting-started.md").read_text()
    (command,) = re.findall(r"`manage\.py (dryrun\s+[^`]+)`", text)
    with examples("getting_started"):
        out = io.StringIO()
        call_command(*shlex.split(command), stdout=out)
    assert "shop.create_order" in out.getvalue() and "shop.charge_card" in out.getvalue()
    assert "Charge 2900" in out.getvalue(), out.getvalue()


def test_the_commands_getting_started_says_print_w003_do_and_a_plain_check_does_not(settings):
    """The page said every ``check`` prints W003; a database check runs only with
    ``--database`` and before ``migrate`` (#38)."""
    settings.SILENCED_SYSTEM_CHECKS = []
    text = " ".join((ROOT / "docs" / "getting-started.md").read_text().split())
    (said,) = re.findall(r"demo's\), every ((?:`[^`]+`(?: and )?)+) prints", text)
    commands = re.findall(r"`([^`]+)`", said)
    assert commands == ["migrate", "check --database default"], said

    def printed(*args: str) -> str:
        err = io.StringIO()
        # As from the shell: call_command skips a command's checks unless told not to.
        extra = {} if args[0] == "check" else {"skip_checks": False}
        call_command(*args, stdout=io.StringIO(), stderr=err, **extra)
        return err.getvalue()

    for command in commands:
        assert "k2b_workflows.W003" in printed(*shlex.split(command)), command
    assert "k2b_workflows.W003" not in printed("check")


# -- docs/effects.md -----------------------------------------------------------------------


def test_a_transactional_write_commits_once_across_a_crash():
    with examples("effects") as (effects,):
        from docs.examples.models import Stock

        Stock.objects.create(sku="TEA-01", free=5)
        one_step("shop.reserve_one", effects.ReserveStock, app_id="shop")
        # The crash comes after the UPDATE, inside the kernel's transaction: it rolls
        # back with the journal entry, and the step runs again on the next claim.
        with crash_after_effect(effects.ReserveStock) as lost, fast_retries():
            run = start_workflow_run("shop.reserve_one", {"sku": "TEA-01"})
            run_until_idle()

        assert len(lost) == 1
        assert_run_status(run, "succeeded")
        assert Stock.objects.get().free == 4


def test_an_idempotent_email_is_sent_again_under_the_same_key_after_a_crash():
    with examples("effects") as (effects,):
        from docs.examples.providers import mailer

        one_step("shop.receipt", effects.SendReceipt, app_id="shop")
        with crash_after_effect(effects.SendReceipt) as lost, fast_retries():
            run = start_workflow_run("shop.receipt", {"to": "ada@example.com"})
            run_until_idle()

        assert len(lost) == 1
        assert_run_status(run, "succeeded")
        key = f"{run.pk}:0"
        assert mailer.calls == [key, key]  # run() twice, with the same ctx.effect_key
        assert list(mailer.sent) == [key]  # the provider sent one message


def test_the_dedup_table_keeps_the_sms_from_going_out_twice():
    with examples("effects") as (effects,):
        from docs.examples.providers import sms

        one_step("shop.sms", effects.SendSms, app_id="shop")
        with crash_after_effect(effects.SendSms) as lost, fast_retries():
            run = start_workflow_run("shop.sms", {"to": "+4930123", "text": "shipped"})
            run_until_idle()

        assert len(lost) == 1
        assert_run_status(run, "succeeded")
        assert sms.sent == [("+4930123", "shipped")]
        assert DedupRecord.objects.filter(key=f"{run.pk}:0", name="sms").count() == 1


def test_a_charge_reconciled_absent_is_sent_again_under_its_key_and_made_once(monkeypatch):
    with examples("effects") as (effects,):
        from docs.examples.providers import gateway

        charge = gateway.charge

        def lost_once(amount: int, *, idempotency_key: str) -> Any:
            if not gateway.calls:  # the first request never reaches the gateway
                gateway.calls.append(idempotency_key)
                raise ConnectionError("reset before the gateway got the request")
            return charge(amount, idempotency_key=idempotency_key)

        monkeypatch.setattr(gateway, "charge", lost_once)
        one_step("shop.pay", effects.ChargeByKey, app_id="shop")
        with fast_retries():
            run = start_workflow_run("shop.pay", {"amount": 2900})
            run_until_idle()

        # Doubt after the dispatch; reconcile() finds no charge, the step runs again
        # with the same ctx.effect_key, and the gateway made one charge.
        assert_run_status(run, "succeeded")
        key = f"{run.pk}:0"
        assert gateway.calls == [key, key]
        assert list(gateway.charges) == [key]
        assert refreshed(run).output == {"charge_id": "ch_1"}
        assert ledger_kinds(run).count("dispatched") == 2
        assert "reconciled" in ledger_kinds(run)


def test_a_worker_whose_lease_was_taken_commits_no_fenced_write():
    with examples("effects") as (effects,):
        from django.db import connection

        from docs.examples.models import Invoice
        from docs.examples.providers import provider

        one_step("shop.invoice", effects.CreateInvoice, app_id="shop")
        run = start_workflow_run("shop.invoice", {"order": 42})

        def taken_over() -> None:
            # While the first worker waits for the provider, its lease runs out and
            # another worker claims the run (a higher generation), then dies too.
            provider.during_call = None
            with connection.cursor() as cursor:
                cursor.execute(
                    "UPDATE k2b_run SET generation = generation + 1,"
                    " lease_expires_at = statement_timestamp() - interval '1 ms'"
                    " WHERE id = %s AND status = 'running'",
                    [run.pk],
                )
                assert cursor.rowcount == 1

        provider.during_call = taken_over
        with fast_retries():
            run_until_idle()

        assert_run_status(run, "succeeded")
        key = f"{run.pk}:0"
        assert provider.calls == [key, key]  # the stale worker and the one after it
        # Only the holder of the lease stored the invoice: the stale write raised LeaseLost.
        assert list(Invoice.objects.values_list("number", "order_id")) == [("INV-42-1", 42)]


# -- docs/waits.md -------------------------------------------------------------------------


def test_the_approval_view_wakes_the_waiting_run():
    with examples("waits", "waits_wake") as (waits, views):
        one_step("shop.approved_order", waits.WaitForApproval, app_id="shop")
        run = start_workflow_run("shop.approved_order", {"order": 42})
        run_until_idle()
        run = refreshed(run)
        assert (run.status, run.wait_kind, run.wait_key) == ("waiting", "approval", "order-42")

        # A wake under another app, or one that rolls back, wakes nobody.
        assert wake_workflow_runs_waiting_on(app_id="other", kind="approval", key="order-42") == 0
        user = get_user_model().objects.create_user("manager")
        with pytest.raises(RuntimeError), transaction.atomic():
            views.approve(SimpleNamespace(user=user), 42)
            raise RuntimeError("the view failed after approving")
        assert refreshed(run).status == "waiting"

        views.approve(SimpleNamespace(user=user), 42)
        assert refreshed(run).status == "queued"
        run_until_idle()
        assert_run_status(run, "succeeded")
        assert refreshed(run).output == {"approved_by": user.pk}


def test_an_approval_nobody_gives_in_24_hours_expires_at_the_deadline():
    with examples("waits_deadline") as (waits,), controlled_clock() as clock:
        one_step("shop.expiring_approval", waits.WaitForApprovalOrExpire, app_id="shop")
        clock.advance(days=2)
        run = start_workflow_run("shop.expiring_approval", {"order": 7})
        run_until_idle()
        assert refreshed(run).status == "waiting"

        clock.advance(hours=23)
        run_until_idle()
        assert refreshed(run).status == "waiting"

        clock.advance(hours=1)
        run_until_idle()
        assert_run_status(run, "failed", error_code="APPROVAL_EXPIRED")
        assert (
            refreshed(run).error_message == f"nobody approved by {clock.now():%Y-%m-%d %H:%M} UTC"
        )


def test_an_approval_given_before_the_deadline_is_not_expired():
    with examples("waits_deadline", "waits_wake") as (waits, views), controlled_clock() as clock:
        one_step("shop.expiring_approval", waits.WaitForApprovalOrExpire, app_id="shop")
        run = start_workflow_run("shop.expiring_approval", {"order": 8})
        run_until_idle()
        clock.advance(hours=23)
        user = get_user_model().objects.create_user("late-manager")
        views.approve(SimpleNamespace(user=user), 8)
        clock.advance(hours=2)  # past the deadline, but the wake came first
        run_until_idle()
        assert_run_status(run, "succeeded")
        assert refreshed(run).output == {"approved_by": user.pk}


def test_the_wake_of_testing_md_runs():
    """docs/testing.md shows the wake inline; it runs here as the page shows it."""
    wake = block(
        "docs/testing.md",
        'wake_workflow_runs_waiting_on(app_id="shop", kind="approval", key="order-1")',
    )
    with examples("waits") as (waits,):
        from docs.examples.models import Approval

        one_step("shop.approved_order", waits.WaitForApproval, app_id="shop")
        run = start_workflow_run("shop.approved_order", {"order": 1})
        run_until_idle()
        assert refreshed(run).status == "waiting"
        Approval.objects.create(order_id=1, user=get_user_model().objects.create_user("m"))

        exec(
            compile(wake.code, wake.where, "exec"),
            {**public_api(), "run_until_idle": run_until_idle},
        )

        assert_run_status(run, "succeeded")


@pytest.mark.parametrize(
    ("answer", "status", "error_code"),
    [
        ("settled", "succeeded", None),
        ("rejected", "failed", "PAYOUT_REJECTED"),
        ("reversed", "needs_attention", "EFFECT_OUTCOME_UNKNOWN"),
    ],
)
def test_a_pending_payout_is_polled_until_the_bank_answers(answer, status, error_code):
    with examples("waits_polling") as (polling,):
        from docs.examples.providers import bank

        one_step("shop.pay_out", polling.Payout, app_id="shop")
        run = start_workflow_run("shop.pay_out", {"amount": 500})
        run_until_idle()
        key = f"{run.pk}:0"
        run = refreshed(run)
        assert (run.status, run.wait_kind, run.wait_key) == ("waiting", "payout", key)
        assert bank.payouts == {key: {"amount": 500, "state": "pending"}}

        # The bank's webhook wakes the run before the deadline; still pending: it waits again.
        assert wake_workflow_runs_waiting_on(app_id="shop", kind="payout", key=key) == 1
        run_until_idle()
        assert refreshed(run).status == "waiting"

        bank.settle(key, answer)
        wake_workflow_runs_waiting_on(app_id="shop", kind="payout", key=key)
        run_until_idle()

        assert_run_status(run, status, error_code=error_code)
        if status == "succeeded":
            assert refreshed(run).output == {"settled": True}
        kinds = ledger_kinds(run)
        assert kinds.count("dispatched") == 1  # dispatched once, polled three times
        assert kinds.count("pending") == 2
        assert bank.status_queries == 3


# -- docs/fan-out.md -----------------------------------------------------------------------


def test_the_checkout_ships_each_item_in_a_child_run():
    with examples("fan_out") as _:
        from docs.examples.providers import courier

        run = start_workflow_run("shop.checkout", {"items": ["teapot", "cup", "saucer"]})
        run_until_idle()

        assert_run_status(run, "succeeded")
        assert refreshed(run).output == {"shipped": 3}
        counts = count_child_workflow_runs(run.pk)
        assert (counts["succeeded"], counts["total"]) == (3, 3)  # none created twice
        assert sorted(courier.bookings.values()) == ["cup", "saucer", "teapot"]


def test_the_report_budget_allows_100_emails_and_refuses_the_101st():
    with examples("budgets") as _:
        from docs.examples.providers import mailer

        addresses = [f"r{i}@example.com" for i in range(101)]
        run = start_workflow_run("reports.send_all", {"to": addresses})
        run_until_idle()

        assert_run_status(run, "failed", error_code="EFFECT_BUDGET_EXCEEDED")
        assert len(mailer.sent) == 100  # the 101st step failed before its effect
        assert BudgetCharge.objects.filter(run=run, unit="emails").count() == 100


def test_a_failed_import_forked_after_the_fix_fetches_nothing_again():
    with examples("forks") as (forks,):
        run = start_workflow_run("imports.load", {"url": "https://example.com/a.csv"})
        run_until_idle()
        assert_run_status(run, "failed", error_code="PARSE_ERROR")

        forks.PARSER["fixed"] = True
        fork = forks.fork_after_the_fix(run.pk, "ops@example.com")
        run_until_idle()

        assert_run_status(fork, "succeeded")
        assert refreshed(fork).output == {"parsed": 1}
        assert len(forks.FETCHED) == 1  # kept as recorded: not fetched again
        assert fork.forked_from_id == run.pk


def test_the_ai_task_asks_the_provider_once_and_the_step_gets_its_answer():
    with examples("ai_tasks") as (ai_tasks,):
        from docs.examples.providers import client

        one_step("support.summarize_ticket", ai_tasks.Summarize, app_id="support", max_ai_calls=1)
        run = start_workflow_run("support.summarize_ticket", {"text": "the kettle leaks"})
        run_until_idle()

        assert_run_status(run, "succeeded")
        assert refreshed(run).output == {"summary": "summary of 1 message(s)"}
        assert client.calls == [[{"role": "user", "content": "Summarize: the kettle leaks"}]]
        assert AiTask.objects.filter(run_id=run.pk).count() == 1


def test_the_dry_run_example_prints_the_plan_of_the_checkout(capsys):
    with examples("getting_started", "dry_runs") as (_, dry_runs):
        report = dry_runs.print_checkout_plan()
    assert report.ok and report.errors == []
    assert [(s.seq, s.action) for s in report.steps] == [
        (0, "shop.create_order"),
        (1, "shop.charge_card"),
    ]
    assert report.cost == {"charges": 1} and report.within_budget
    assert capsys.readouterr().out.splitlines() == [
        "0 shop.create_order Order TEA-01 {}",
        "1 shop.charge_card Charge 2900 {'charges': 1}",
        "{'charges': 1} True",
        "[]",
    ]


# -- docs/changing-code.md -----------------------------------------------------------------


def test_versions_run_side_by_side_each_run_on_its_own():
    with examples("changing_code_actions", "changing_code_versions"):
        new = start_workflow_run("shop.checkout", {"sku": "TEA-01"})
        old = start_workflow_run("shop.checkout", {"sku": "TEA-01"}, version=1)
        run_until_idle()

        assert (new.workflow_version, old.workflow_version) == (2, 1)
        assert_run_status(new, "succeeded")
        assert_run_status(old, "succeeded")
        assert journal_actions(new) == [
            "shop.create_order",
            "shop.reserve_stock",
            "shop.charge_card",
        ]
        assert journal_actions(old) == ["shop.create_order", "shop.charge_card"]


def old_run_in_doubt(module: str) -> tuple[Any, Any]:
    """A checkout under ``module``'s code whose charge crashed: needs_attention at the charge."""
    from docs.examples.changing_code_actions import ChargeCard

    with examples(module), crash_after_effect(ChargeCard):
        run = start_workflow_run("shop.checkout", {"sku": "TEA-01"}, version=1)
        run_until_idle()
    assert_run_status(run, "needs_attention", error_code="EFFECT_OUTCOME_UNKNOWN")
    return run, journal_actions(run)


def confirm_charge(run: Any, actor: Any) -> None:
    resolve_effect(
        run.pk,
        EFFECT_CONFIRMED,
        evidence="the gateway shows ch_1",
        actor=actor,
        output={"charge_id": "ch_1"},
    )


def test_a_patch_takes_the_new_branch_only_where_the_run_had_not_passed_it():
    old, before = old_run_in_doubt("changing_code_versions")  # version 1: no patch yet
    assert before == ["shop.create_order"]
    with examples("changing_code_patch"):
        confirm_charge(old, superuser())
        new = start_workflow_run("shop.checkout", {"sku": "TEA-01"})
        run_until_idle()

        assert_run_status(old, "succeeded")
        assert_run_status(new, "succeeded")
        # The old run had dispatched its charge where the patch now stands: old branch.
        assert journal_actions(old) == ["shop.create_order", "shop.charge_card"]
        assert journal_actions(new) == [
            "shop.create_order",
            "k2b.patch:reserve-stock",
            "shop.reserve_stock",
            "shop.charge_card",
        ]


def test_a_deprecated_patch_replays_runs_that_took_it_and_marks_no_new_run():
    patched, before = old_run_in_doubt("changing_code_patch")
    assert before == ["shop.create_order", "k2b.patch:reserve-stock", "shop.reserve_stock"]
    with examples("changing_code_deprecated"):
        confirm_charge(patched, superuser())
        new = start_workflow_run("shop.checkout", {"sku": "TEA-01"})
        run_until_idle()

        assert_run_status(patched, "succeeded")
        assert_run_status(new, "succeeded")
        assert journal_actions(patched) == [*before, "shop.charge_card"]
        assert journal_actions(new) == [
            "shop.create_order",
            "shop.reserve_stock",
            "shop.charge_card",
        ]


def test_removing_a_patch_while_runs_carry_its_marker_is_nondeterministic():
    patched, _ = old_run_in_doubt("changing_code_patch")
    with examples("changing_code_versions"):  # version 1 without the patch call
        confirm_charge(patched, superuser())
        run_until_idle()
    assert_run_status(patched, "needs_attention", error_code="WORKFLOW_NONDETERMINISTIC")


# -- docs/operators.md, docs/operations.md, docs/reference.md -------------------------------


class LostPayout(Action):
    """EXTERNAL, no reconcile(): the connection drops after the request went out."""

    name = "ops.lost_payout"
    effect = Effect.EXTERNAL

    def plan(self, ctx: Any, input: Any) -> Any:
        return succeeded({"planned": True})

    def run(self, ctx: Any, input: Any) -> Any:
        raise ConnectionError("reset after the request was sent")


def test_the_receiver_pages_with_a_link_to_the_resolution_form():
    from k2b_workflows.signals import run_needs_attention

    with examples("operators_signals") as (signals,):
        from docs.examples.providers import pager

        try:
            one_step("ops.payout", LostPayout, app_id="ops")
            run = start_workflow_run("ops.payout", {})
            run_until_idle()
        finally:
            assert run_needs_attention.disconnect(signals.page_on_call)

        assert_run_status(run, "needs_attention", error_code="EFFECT_OUTCOME_UNKNOWN")
        assert pager.pages == [
            (
                f"ops.payout {run.pk} needs a decision: EFFECT_OUTCOME_UNKNOWN",
                f"https://ops.example.com/admin/k2b_workflows/incident/{run.pk}/resolve/",
            )
        ]


@pytest.fixture
def restore_logging() -> Any:
    names = ["k2b_workflows", "k2b_workflows.events", "k2b_workflows.fleet"]
    saved = {
        name: (list(lg.handlers), lg.level, lg.propagate)
        for name in names
        for lg in [logging.getLogger(name)]
    }
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


def test_the_json_formatter_writes_one_object_per_line_with_the_run_fields(capsys, restore_logging):
    with examples("getting_started", "logging_json") as (shop, logging_json):
        logging.config.dictConfig(logging_json.LOGGING)
        with crash_after_effect(shop.ChargeCard), fast_retries():
            run = start_workflow_run("shop.checkout", {"sku": "TEA-01", "amount": 2900})
            run_until_idle()
    assert_run_status(run, "succeeded")
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ours = [line for line in lines if line.get("run_id") == str(run.pk)]
    assert ours, lines
    assert all({"time", "level", "logger", "message", "event"} <= set(line) for line in ours)
    # The charge's doubt is logged with the step's fields, for a JSON pipeline to keep.
    doubt = [line for line in ours if line.get("action") == "shop.charge_card"]
    assert doubt and doubt[0]["effect_key"] == f"{run.pk}:1" and doubt[0]["step"] == 1


def public_api() -> dict[str, Any]:
    return {name: getattr(k2b_workflows, name) for name in k2b_workflows.__all__}


def test_the_reference_imports_every_public_name():
    with examples("public_api") as (reference,):
        imported = {name for name in vars(reference) if not name.startswith("_")}
    assert set(k2b_workflows.__all__) <= imported, set(k2b_workflows.__all__) - imported


# -- docs/schedules.md ---------------------------------------------------------------------


def test_the_nightly_report_fires_at_three_in_berlin_and_the_digest_hourly():
    from k2b_workflows.models import WorkflowSchedule

    with examples("schedules", "schedules_tests") as (_, user_tests):
        # Registered only now, after this database was migrated: the flush a
        # transactional test case ends with writes the decorator's schedule again,
        # as it does for a site's own workflows, and the page's test needs nothing
        # more (#38).
        assert not WorkflowSchedule.objects.filter(schedule_id="reports.nightly").exists()
        call_command("flush", verbosity=0, interactive=False)
        assert WorkflowSchedule.objects.filter(schedule_id="reports.nightly", enabled=True).exists()
        user_tests.test_the_nightly_report_runs_at_three_in_berlin()
        (run,) = WorkflowRun.objects.filter(schedule_id="reports.nightly")
        assert run.output == {"kind": "daily", "day": run.scheduled_for.date().isoformat()}

        user_tests.test_the_digest_goes_out_every_hour_and_catches_up_after_downtime()


# -- docs/tutorial.md ----------------------------------------------------------------------


def test_the_tutorial_approval_wakes_the_demo_checkout():
    from docs.examples import tutorial
    from example_project.demo.models import Order

    order = {
        "sku": "PIANO",
        "items": ["piano"],
        "amount_cents": 120_000,
        "customer": "ada@example.com",
    }
    run = start_workflow_run("shop.checkout", order)  # the demo's, registered by the app
    run_until_idle()
    assert refreshed(run).status == "waiting"

    manager = get_user_model().objects.create_user("manager", email="manager@example.com")
    tutorial.approve(SimpleNamespace(user=manager), Order.objects.get().pk)
    run_until_idle()

    assert_run_status(run, "succeeded")
    assert refreshed(run).output["shipped"] == 1


# -- every example workflow, dry ------------------------------------------------------------

DRY_INPUTS = {
    "getting_started": {"shop.checkout": {"sku": "TEA-01", "amount": 2900}},
    "fan_out": {
        "shop.checkout": {"items": ["teapot", "cup"]},
        "shop.ship_item": {"item": "teapot"},
    },
    "budgets": {"reports.send_all": {"to": ["a@example.com", "b@example.com"]}},
    "changing_code_versions": {"shop.checkout": {"sku": "TEA-01"}},
    "changing_code_patch": {"shop.checkout": {"sku": "TEA-01"}},
    "changing_code_deprecated": {"shop.checkout": {"sku": "TEA-01"}},
}


@pytest.mark.parametrize("module", sorted(DRY_INPUTS))
def test_a_dry_run_of_every_example_workflow_is_ok(module):
    with examples(module):
        registered = workflows.registered_versions()
        assert {d.name for d in registered} == set(DRY_INPUTS[module])
        for definition in registered:
            # dry_run() plans the newest version: register each version alone in turn.
            versions = workflows._registry[definition.name]
            workflows._registry[definition.name] = {definition.version: definition}
            try:
                report = dry_run(definition.name, DRY_INPUTS[module][definition.name])
            finally:
                workflows._registry[definition.name] = versions
            assert report.ok, (definition.name, definition.version, report.errors, report.failed)
            assert report.steps


# -- docs/callers.md -----------------------------------------------------------------------


def test_the_follow_up_sleeps_three_days_on_the_clock_and_sends_twice():
    from k2b_workflows.testing import controlled_clock

    with examples("callers") as (callers,), controlled_clock() as clock:
        callers.OUTBOX.clear()
        run = start_workflow_run("reminders.follow_up", {"to": "ada@example.com"})
        run_until_idle()
        assert refreshed(run).status == "waiting"
        sent = list(callers.OUTBOX)
        assert sent == [(f"{run.pk}:0", "ada@example.com")]
        clock.advance(days=3)
        run_until_idle()
        assert_run_status(run, "succeeded")
        assert [to for _, to in callers.OUTBOX] == ["ada@example.com"] * 2
        # The timeout of seven days was stamped at the start.
        assert refreshed(run).timeout_at - refreshed(run).created_at == dt.timedelta(days=7)


def test_an_unsubscribed_address_fails_at_once_despite_the_patient_policy():
    with examples("callers") as (callers,):
        callers.OUTBOX.clear()
        run = start_workflow_run("reminders.remind_now", {"to": "bob@unsubscribed.example"})
        run_until_idle()
        assert_run_status(run, "failed", error_code="UNSUBSCRIBED")
        assert callers.OUTBOX == []


def test_the_views_answer_with_the_result_of_the_run():
    import asyncio
    import threading

    from asgiref.sync import sync_to_async
    from django.db import connections
    from django.test import RequestFactory

    with examples("callers", "callers_views") as (callers, views):
        stop = threading.Event()

        def worker() -> None:  # the worker process, in a thread for the test
            while not stop.is_set():
                run_until_idle()
                stop.wait(0.02)
            connections.close_all()

        thread = threading.Thread(target=worker)
        thread.start()
        try:
            factory = RequestFactory()
            request = factory.post("/remind/", {"to": "ada@example.com", "key": "r-1"})
            answer = json.loads(views.remind(request).content)
            assert answer["status"] == "succeeded"
            assert answer["output"] == {"message_id": f"{answer['run']}:0"}

            request = factory.post("/remind/", {"to": "eve@example.com", "key": "r-2"})
            response = asyncio.run(views.aremind(request))
            assert json.loads(response.content)["status"] == "succeeded"
            asyncio.run(sync_to_async(connections.close_all)())
        finally:
            stop.set()
            thread.join(60)
        assert [to for _, to in callers.OUTBOX] == ["ada@example.com", "eve@example.com"]


# -- docs/flow-control.md ------------------------------------------------------------------


def test_one_sync_per_tenant_runs_at_a_time_and_paid_tenants_go_first():

    from k2b_workflows.testing import controlled_clock

    with examples("flow_control") as (flow,), controlled_clock() as clock:
        free = flow.sync_later(7, paid=False)
        paid = flow.sync_later(7, paid=True)  # same tenant: queued behind the first
        other = flow.sync_later(8, paid=True)
        # Delayed five minutes: none is active yet, so none holds a slot (#35).
        assert (free.holds_slot, paid.holds_slot, other.holds_slot) == (False, False, False)
        # Not before five minutes from now (run_until_idle moves the clock there).
        assert (refreshed(free).run_after - clock.now()).total_seconds() > 290
        run_until_idle()
        for run in (free, paid, other):
            assert_run_status(run, "succeeded")
        # One at a time for tenant 7: the second began after the first ended. Which
        # goes first is the admission's: by priority when both were due at its pass
        # (paid), the first due when a pass came between them (a loaded host).
        ends = {r.pk: r.finished_at for r in WorkflowRun.objects.all()}
        first, second = sorted((free, paid), key=lambda r: ends[r.pk])
        began = JournalEntry.objects.get(run_id=second.pk, seq=0).started_at
        assert began >= ends[first.pk]
        assert refreshed(paid).priority == 5


def test_a_newer_deploy_cancels_the_one_in_progress():
    from tests.support.kernel import execute_exactly

    with examples("flow_control") as (flow,):
        first = flow.deploy_now("shop", "abc")
        second = flow.deploy_now("shop", "def")
        assert refreshed(first).status == "canceled"
        assert execute_exactly(second.pk) == "succeeded"


def test_the_completion_counts_each_dispatch_against_its_api_key():
    from django.db import connection

    with examples("flow_control"):
        for key in ("k1", "k1", "k2"):
            start_workflow_run("ai.answer", {"api_key_id": key, "prompt": "hi"})
        run_until_idle()
        assert {r.status for r in WorkflowRun.objects.all()} == {"succeeded"}
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT limit_key, count(*) FROM k2b_rate_dispatch GROUP BY 1 ORDER BY 1"
            )
            assert cursor.fetchall() == [("openai.complete:k1", 2), ("openai.complete:k2", 1)]


def test_exports_wait_in_their_paused_queue_and_run_once_it_is_resumed():
    from tests.support.admin import user_with

    with examples("flow_control") as (flow,):
        operator = user_with("pause_queue")
        flow.hold_exports(operator)
        held = flow.export_now(7)
        urgent = flow.export_now(8, urgent=True)
        assert (held.queue, urgent.queue) == ("exports", "urgent")
        run_until_idle()
        assert (refreshed(held).status, refreshed(urgent).status) == ("queued", "succeeded")
        flow.release_exports(operator)
        run_until_idle()
        assert_run_status(held, "succeeded")


def test_the_tracing_example_puts_the_run_in_the_requests_trace():
    """In a process of its own (``tests/support/tracing_example.py``): a tracer provider is
    global."""
    import os
    import subprocess
    import sys

    from django.db import connection

    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "K2B_TEST_DB_NAME": connection.settings_dict["NAME"],
    }
    done = subprocess.run(
        [sys.executable, "tests/support/tracing_example.py"],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    spans = json.loads(done.stdout.strip().splitlines()[-1])
    (request,) = [s for s in spans if s["name"] == "POST /orders"]
    runs = [s for s in spans if s["name"] == "k2b.run"]
    steps = [s for s in spans if s["name"] == "k2b.step"]
    assert {s["trace_id"] for s in spans} == {request["trace_id"]}
    assert [r["parent"] for r in runs] == [request["span_id"]]
    assert [s["attributes"]["k2b.action"] for s in steps] == [
        "shop.create_order",
        "shop.charge_card",
    ]
    assert {s["parent"] for s in steps} == {runs[0]["span_id"]}
    assert runs[0]["attributes"]["k2b.outcome"] == "succeeded"


def _tasks_example():
    """docs/examples/tasks.py in the examples' registries, with the task workflows."""
    from k2b_workflows.tasks import runs as task_runs

    return examples("tasks"), task_runs.register


def test_the_tasks_example_charges_once_and_enqueues_nothing_when_the_order_fails():
    from docs.examples import providers

    context, register = _tasks_example()
    with context as (tasks,):
        register()
        result_id = tasks.place_order("o-1", 2900, "ann@example.com")
        run_until_idle()
        charged = tasks.charge.get_result(result_id)
        assert str(charged.status) == "SUCCESSFUL"
        assert charged.return_value["order"] == "o-1"
        assert len(providers.gateway.charges) == 1
        assert WorkflowRun.objects.get(pk=result_id).queue == "default"
        assert WorkflowRun.objects.filter(queue="mail", status="succeeded").count() == 1
        before = WorkflowRun.objects.count()
        try:
            with transaction.atomic():
                tasks.place_order("o-2", 100, "bob@example.com")
                raise RuntimeError("the order could not be saved")
        except RuntimeError:
            pass
        assert WorkflowRun.objects.count() == before


def test_the_tasks_example_reconcile_finds_the_charge_or_says_call_again():
    """The reconcile of docs/tasks.md, asked as a worker asks it (the crash that makes a
    worker ask is tests/tasks/test_settle.py's): it finds a charge made under the
    call's effect key, and says "call it again" for one never made."""
    from docs.examples import providers
    from k2b_workflows.actions import Failed, Succeeded
    from k2b_workflows.tasks.compat import base_api

    context, register = _tasks_example()
    with context as (tasks,):
        register()
        options = tasks.charge_once.get_backend().options_of(tasks.charge_once)
        assert options.reconcile == "docs.examples.tasks.find_charge"
        made = tasks.charge_once.enqueue("o-9", 500)
        run_until_idle()
        never = tasks.charge_once.enqueue("o-10", 700)  # not run: nothing charged under its key
        assert len(providers.gateway.charges) == 1
        found = tasks.find_charge(base_api.TaskContext(task_result=made), "o-9", 500)
        assert isinstance(found, Succeeded)
        assert found.output == tasks.charge_once.get_result(made.id).return_value
        missing = tasks.find_charge(base_api.TaskContext(task_result=never), "o-10", 700)
        assert isinstance(missing, Failed) and missing.retryable


def test_the_tasks_example_backoff_spaces_attempts_and_stops_at_a_refusal():
    """docs/tasks.md's attempts, backoff and timeout: a feed that does not answer is
    tried five times, 2, 4, 8 and 16 s apart; a refused one once; a good one returns."""
    import datetime as dt

    from k2b_workflows.testing import controlled_clock

    context, register = _tasks_example()
    with context as (tasks,), controlled_clock() as clock:
        register()
        down = tasks.fetch_feed.enqueue("https://example.com/gone")
        run_until_idle()
        assert dt.timedelta(seconds=29) <= clock.offset < dt.timedelta(seconds=35)
        refused = tasks.fetch_feed.enqueue("http://example.com/feed")
        good = tasks.fetch_feed.enqueue("https://example.com/feed")
        run_until_idle()
        down, refused, good = (tasks.fetch_feed.get_result(r.id) for r in (down, refused, good))
        assert (len(down.errors), down.status) == (5, "FAILED")
        assert (len(refused.errors), refused.status) == (1, "FAILED")
        assert good.return_value == ["first post"]


def test_the_tasks_example_reports_how_far_it_got():
    context, register = _tasks_example()
    with context as (tasks,):
        register()
        result = tasks.reindex.enqueue([11, 12, 13])
        assert tasks.how_far(result.id) is None
        run_until_idle()
        assert tasks.how_far(result.id) == "3/3 document 13"


def test_the_tasks_example_cancel_stops_a_call_not_started_and_lets_one_run_finish():
    context, register = _tasks_example()
    with context as (tasks,):
        register()
        stopped = tasks.reindex_site.enqueue("site-1", ["a", "b"])
        canceled = tasks.stop_reindex(stopped.id)
        assert str(canceled.status) == "FAILED"
        assert canceled.errors[-1].exception_class_path.endswith(".RunCanceled")
        whole = tasks.reindex_site.enqueue("site-2", ["a", "b"])
        run_until_idle()
        assert tasks.reindex_site.get_result(whole.id).return_value == {"indexed": 2}
        assert WorkflowRun.objects.get(pk=stopped.id).status == "canceled"


def test_the_tasks_example_invoices_many_and_schedules_one():
    from k2b_workflows.models import WorkflowSchedule

    context, register = _tasks_example()
    with context as (tasks,):
        register()
        results = tasks.invoice_all([{"id": i, "lines": [{"amount": i}]} for i in range(50)])
        run_until_idle()
        assert tasks.render_invoice.get_result(results[7].id).return_value == {
            "order": 7,
            "total": 7,
        }
        schedule = tasks.schedule_nightly_invoices()
        assert WorkflowSchedule.objects.get(pk=schedule.pk).workflow_name == "k2b.task.pure"


def test_the_tasks_example_rebuilds_a_site_once_and_syncs_the_last_edit():
    from k2b_workflows.testing import controlled_clock

    context, register = _tasks_example()
    with context as (tasks,), controlled_clock():
        register()
        first = tasks.rebuild_index.enqueue(7)
        assert tasks.rebuild_index.enqueue(site_id=7, verbose=True).id == first.id
        edit = tasks.sync_profile.enqueue(1, {"name": "A"})
        assert tasks.sync_profile.enqueue(1, {"name": "B"}).id == edit.id
        waiting = WorkflowRun.objects.get(pk=edit.id)
        assert waiting.run_after >= waiting.created_at + dt.timedelta(seconds=30)
        run_until_idle()  # moves the controlled clock to the debounced start
        assert tasks.rebuild_index.get_result(first.id).return_value == {"site": 7}
        assert tasks.sync_profile.get_result(edit.id).return_value == {
            "user": 1,
            "fields": {"name": "B"},
        }


def test_the_tasks_example_serves_a_small_tenant_beside_a_large_ones_backlog():
    from k2b_workflows.tasks import enqueue_many

    context, register = _tasks_example()
    with context as (tasks,):
        register()
        enqueue_many(tasks.export_report, [(("big", n), None) for n in range(100)])
        small = tasks.export_report.enqueue("small", "monthly")
        run_until_idle()
        order = list(
            WorkflowRun.objects.filter(task_path=tasks.export_report.module_path)
            .order_by("finished_at")
            .values_list("pk", flat=True)
        )
        assert len(order) == 101
        assert order.index(uuid.UUID(small.id)) < 10, order.index(uuid.UUID(small.id))


def test_the_tasks_example_reports_a_batch_once_when_every_invoice_has_finished():
    context, register = _tasks_example()
    with context as (tasks,):
        register()
        batch_id = tasks.invoice_all_then_report(
            [{"id": i, "lines": [{"amount": i}]} for i in range(20)]
        )
        assert tasks.batch_status(batch_id).ready == 20
        run_until_idle()
        status = tasks.batch_status(batch_id)
        assert (status.successful, status.failed) == (20, 0)
        assert status.finished_at is not None
        reports = WorkflowRun.objects.filter(task_path="docs.examples.tasks.invoices_mailed")
        assert [r.output for r in reports] == [{"invoiced": 20, "failed": 0}]
        assert not WorkflowRun.objects.filter(task_path="docs.examples.tasks.invoices_failed")


def test_the_tasks_example_pays_out_within_its_budget_and_refuses_more():
    from docs.examples import providers
    from k2b_workflows.models import BudgetCharge

    context, register = _tasks_example()
    with context as (tasks,):
        register()
        result_id = tasks.pay_partner("p-1", 20_000)
        run_until_idle()
        paid = tasks.pay_out.get_result(result_id)
        assert str(paid.status) == "SUCCESSFUL"
        assert paid.return_value["partner"] == "p-1"
        assert [c.amount for c in providers.gateway.charges.values()] == [20_000]
        charged = BudgetCharge.objects.filter(run_id=result_id)
        assert list(charged.values_list("unit", "amount")) == [("cents", 20_000)]
        before = WorkflowRun.objects.count()
        assert tasks.pay_partner("p-2", 60_000) is None
        assert WorkflowRun.objects.count() == before
