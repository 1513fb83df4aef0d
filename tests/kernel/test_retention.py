"""Retention: whole finished trees go, with their append-only evidence; nothing else does."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.management import call_command
from django.db import connection

from k2b_workflows import start_workflow_run
from k2b_workflows.models import (
    BudgetAccount,
    BudgetCharge,
    JournalEntry,
    LedgerEntry,
    WaitRendezvous,
    WorkflowRun,
)
from k2b_workflows.retention import purge_finished_runs
from k2b_workflows.testing import run_until_idle

pytestmark = pytest.mark.django_db(transaction=True)

MONTH = dt.timedelta(days=30)


def age(*runs: WorkflowRun, days: int = 40) -> None:
    """Pretend the runs (and their rendezvous) ended ``days`` ago."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE k2b_run SET finished_at = finished_at - %s WHERE id = ANY(%s)",
            [dt.timedelta(days=days), [r.pk for r in runs]],
        )
        cursor.execute(
            "UPDATE k2b_wait SET created_at = created_at - %s, signaled_at = signaled_at - %s",
            [dt.timedelta(days=days), dt.timedelta(days=days)],
        )


def test_old_finished_trees_are_deleted_with_journal_ledger_and_charges():
    charged = start_workflow_run("test.charge", {"amount": 5})
    failed = start_workflow_run("test.guarded", {"deny": "raise"})
    run_until_idle()
    age(charged, failed)
    assert LedgerEntry.objects.filter(run=charged).exists()
    assert BudgetCharge.objects.filter(run=charged).exists()

    counts = purge_finished_runs(older_than=MONTH)

    assert counts["run trees"] == 2
    assert not WorkflowRun.objects.exists()
    assert not JournalEntry.objects.exists()
    assert not LedgerEntry.objects.exists()
    assert not BudgetCharge.objects.exists()
    assert not BudgetAccount.objects.exists()


def test_recent_runs_and_runs_needing_attention_are_kept():
    recent = start_workflow_run("test.pure", {"a": 1, "b": 1})
    incident = start_workflow_run("test.charge_blind", {"behaviour": "ambiguous"})
    run_until_idle()
    age(incident)
    assert WorkflowRun.objects.get(pk=incident.pk).status == "needs_attention"

    assert purge_finished_runs(older_than=MONTH)["run trees"] == 0
    assert set(WorkflowRun.objects.values_list("pk", flat=True)) == {recent.pk, incident.pk}


def test_a_tree_with_a_child_still_waiting_is_kept():
    parent = start_workflow_run("test.pure", {"a": 1, "b": 1})
    run_until_idle()
    child = start_workflow_run("test.wait", {"key": "never"}, parent=parent)
    run_until_idle()
    age(parent)
    assert WorkflowRun.objects.get(pk=child.pk).status == "waiting"

    assert purge_finished_runs(older_than=MONTH)["run trees"] == 0
    assert WorkflowRun.objects.filter(pk=parent.pk).exists()
    # The rendezvous a waiting run refers to is kept however old it is.
    assert WaitRendezvous.objects.filter(key="never").exists()


def test_dry_run_counts_and_deletes_nothing():
    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    run_until_idle()
    age(run)

    counts = purge_finished_runs(older_than=MONTH, dry_run=True)

    assert counts["run trees"] == 1 and counts["journal entries"] == 2
    assert WorkflowRun.objects.filter(pk=run.pk).exists()
    assert JournalEntry.objects.filter(run=run).count() == 2


def test_the_command_purges_in_batches(capsys):
    runs = [start_workflow_run("test.pure", {"a": i, "b": 1}) for i in range(3)]
    run_until_idle()
    age(*runs)

    call_command("purgeworkflows", "--older-than-days", "30", "--batch", "2")

    assert "deleted: 3 run trees" in capsys.readouterr().out
    assert not WorkflowRun.objects.exists()
