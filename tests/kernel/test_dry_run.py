"""Dry runs: plan() in place of every effect, costs and authorization as in execution, no writes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from k2b_workflows import dry_run
from tests.models import ProviderCall
from tests.support.processes import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

PAYER = {"roles": ["payer"]}

KERNEL_TABLES = [
    "k2b_run",
    "k2b_journal",
    "k2b_ledger",
    "k2b_budget_account",
    "k2b_budget_charge",
    "k2b_wait",
    "k2b_ai_task",
    "k2b_dedup",
]


def row_counts() -> dict[str, int]:
    with connection.cursor() as cursor:
        counts = {}
        for table in KERNEL_TABLES:
            cursor.execute(f"SELECT count(*) FROM {table}")
            counts[table] = cursor.fetchone()[0]
    return counts


def test_dry_run_reports_steps_summaries_and_costs_without_calling_any_effect():
    report = dry_run("fanout.checkout", {"amount": 5, "to": "ann"}, principal=PAYER)

    assert [(s.seq, s.action, s.summary, s.cost) for s in report.steps] == [
        (0, "test.add", "add", {}),
        (1, "fanout.pay", "Pay 5", {"payments": 5}),
        (2, "fanout.send", "Send to ann", {"sends": 1}),
    ]
    assert report.steps[1].output == {"planned": True, "amount": 5}
    assert report.cost == {"payments": 5, "sends": 1}
    assert report.within_budget
    assert (report.errors, report.failed, report.output) == ([], None, {"paid": 5})
    assert not ProviderCall.objects.exists()  # neither fanout.pay nor fanout.send ran


def test_dry_run_over_budget_is_reported_not_refused():
    report = dry_run("fanout.checkout", {"amount": 11}, principal=PAYER)

    assert report.cost["payments"] == 11
    assert not report.within_budget
    assert not report.ok
    assert len(report.steps) == 3


def test_plan_output_without_planned_true_is_an_error():
    report = dry_run("fanout.checkout", {"amount": 5, "bad_plan": True}, principal=PAYER)

    assert len(report.errors) == 1
    assert "planned" in report.errors[0] and "fanout.pay" in report.errors[0]
    assert not report.ok


def test_non_pure_action_without_plan_is_an_error_and_never_runs():
    report = dry_run("fanout.checkout", {"amount": 5, "unplanned": True}, principal=PAYER)

    assert len(report.errors) == 1
    assert "fanout.unplanned" in report.errors[0] and "plan()" in report.errors[0]
    assert not ProviderCall.objects.filter(action="fanout.unplanned").exists()


def test_authorize_denial_is_reported_on_its_step():
    report = dry_run("fanout.checkout", {"amount": 5}, principal={"roles": []})

    denied = report.steps[-1]
    assert (denied.action, denied.error) == ("fanout.pay", "FORBIDDEN")
    assert report.failed == "FORBIDDEN"
    assert not report.ok
    assert not ProviderCall.objects.exists()


def test_dry_run_writes_nothing_a_worker_could_pick_up():
    before = row_counts()

    dry_run("fanout.dry_tree", {"to": ["a", "b"]})
    dry_run("fanout.create_from_run", {"items": [{"value": 1}]})
    dry_run("fanout.create_from_ctx", {"inputs": [{"value": 1}]})

    assert row_counts() == before
    # Only the PURE fanout.spawn ran (it records itself); no effect did.
    assert set(ProviderCall.objects.values_list("action", flat=True)) == {"fanout.spawn"}


def test_children_and_ai_tasks_are_planned_and_counted_against_the_budget():
    report = dry_run("fanout.dry_tree", {"to": ["a", "b", "c"]})

    assert [(s.run, s.action) for s in report.steps] == [
        ("", "fanout.ask_ai"),
        ("1[0]", "fanout.send"),
        ("1[1]", "fanout.send"),
        ("1[2]", "fanout.send"),
    ]
    assert report.cost == {"ai_calls": 1, "sends": 3}
    assert report.budget == {"ai_calls": 1, "sends": 2}
    assert not report.within_budget  # three sends against a budget of two
    assert report.output == {"sent": ["succeeded"] * 3}


def test_children_created_from_an_action_in_a_dry_run_are_unsaved_plans():
    report = dry_run("fanout.create_from_ctx", {"inputs": [{"value": 1}, {"value": 2}]})

    assert [(s.run, s.action) for s in report.steps] == [
        ("0[0]", "fanout.echo"),
        ("0[1]", "fanout.echo"),
        ("", "fanout.spawn"),
    ]
    assert report.errors == []


def test_dryrun_command_prints_the_report_as_a_table(capsys):
    call_command(
        "dryrun",
        "fanout.checkout",
        "--input",
        '{"amount": 5, "to": "ann"}',
        "--principal",
        '{"roles": ["payer"]}',
    )

    out = capsys.readouterr().out
    assert "fanout.pay" in out and "Pay 5" in out and "payments=5" in out
    assert "Send to ann" in out
    assert out.rstrip().endswith("OK")


def test_dryrun_command_fails_when_over_budget():
    with pytest.raises(CommandError, match="over budget") as raised:
        call_command(
            "dryrun",
            "fanout.checkout",
            "--input",
            '{"amount": 50}',
            "--principal",
            '{"roles": ["payer"]}',
        )
    assert raised.value.returncode == 1


def test_dryrun_command_exits_non_zero_on_errors():
    from django.db import connection as conn

    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "manage.py"),
            "dryrun",
            "fanout.checkout",
            "--input",
            '{"amount": 5, "bad_plan": true}',
            "--principal",
            '{"roles": ["payer"]}',
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "K2B_TEST_DB_NAME": conn.settings_dict["NAME"],
        },
    )

    assert result.returncode == 1
    assert "Errors:" in result.stdout and "planned" in result.stdout
    assert "1 error(s)" in result.stderr
