"""Integrity the database enforces: append-only journal and ledger, hash chains, the run FSM."""

from __future__ import annotations

import pgtrigger
import pytest
from django.db import DatabaseError, connection, transaction

from k2b_workflows import results as results_module
from k2b_workflows import start_workflow_run, wake_workflow_runs_waiting_on
from k2b_workflows.models import JournalEntry, LedgerEntry, WorkflowRun
from k2b_workflows.store import INTEGRITY_CHAIN_BROKEN
from tests.models import DomainRow
from tests.support.kernel import describe, fresh, run_to_end

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def finished_external_run():
    run = start_workflow_run("test.charge", {"amount": 3})
    run_to_end()
    assert fresh(run).status == "succeeded"
    return run


def _refused(sql: str, params: list) -> None:
    with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params)


def test_journal_rows_cannot_be_updated(finished_external_run):
    _refused("UPDATE k2b_journal SET output = '{}' WHERE run_id = %s", [finished_external_run.pk])
    assert JournalEntry.objects.get(run=finished_external_run).output["charge_id"]


def test_journal_rows_cannot_be_deleted(finished_external_run):
    _refused("DELETE FROM k2b_journal WHERE run_id = %s", [finished_external_run.pk])
    assert JournalEntry.objects.filter(run=finished_external_run).count() == 1


def test_ledger_rows_cannot_be_updated(finished_external_run):
    _refused(
        "UPDATE k2b_ledger SET message = 'edited' WHERE run_id = %s", [finished_external_run.pk]
    )
    assert not LedgerEntry.objects.filter(message="edited").exists()


def test_ledger_rows_cannot_be_deleted(finished_external_run):
    count = LedgerEntry.objects.filter(run=finished_external_run).count()
    _refused("DELETE FROM k2b_ledger WHERE run_id = %s", [finished_external_run.pk])
    assert LedgerEntry.objects.filter(run=finished_external_run).count() == count


def test_a_tampered_journal_entry_blocks_success():
    run = start_workflow_run("kernel.tamper", {"key": "go"})
    run_to_end()
    assert fresh(run).status == "waiting"
    with pgtrigger.ignore("k2b_workflows.JournalEntry:journal_append_only"):
        updated = JournalEntry.objects.filter(run=run, seq=0).update(output={"n": 999})
    assert updated == 1
    DomainRow.objects.create(key="go")
    wake_workflow_runs_waiting_on(app_id="tests", kind="signal", key="go")
    run_to_end()
    state = describe(run)
    assert (state["status"], state["code"]) == ("needs_attention", INTEGRITY_CHAIN_BROKEN)
    assert fresh(run).output is None


def test_a_journal_entry_edited_while_the_run_executes_blocks_its_success():
    """Verified at load is not enough: the chains are read again before success commits."""
    run = start_workflow_run("kernel.tamper_while_running", {})
    run_to_end()
    state = describe(run)
    assert (state["status"], state["code"]) == ("needs_attention", INTEGRITY_CHAIN_BROKEN)
    assert fresh(run).output is None


def test_a_ledger_entry_edited_while_the_run_executes_blocks_its_success():
    """The same for the ledger: its entries, read again at the end, verify field by field."""
    run = start_workflow_run("kernel.ledger_tamper_while_running", {})
    run_to_end()
    state = describe(run)
    assert (state["status"], state["code"]) == ("needs_attention", INTEGRITY_CHAIN_BROKEN)
    assert "ledger entry 1" in state["message"]
    assert fresh(run).output is None


@pytest.mark.parametrize(
    ("attack", "broken"),
    [
        ("journal_anchor", "journal anchor"),
        ("ledger_anchor", "ledger anchor"),
        ("delete_last_ledger_entry", "ledger anchor"),
    ],
)
def test_a_chain_rewritten_while_the_run_executes_blocks_its_success(attack, broken):
    """Every stored hash left as it was: the run row's anchor set back to an empty
    chain's, or the ledger's last entry deleted. The end, which checks the chains as
    the execution wrote them, finds it, and the chains read again say what broke."""
    run = start_workflow_run("kernel.chain_rewritten_while_running", {"attack": attack})
    run_to_end()
    state = describe(run)
    assert (state["status"], state["code"]) == ("needs_attention", INTEGRITY_CHAIN_BROKEN), state
    assert broken in state["message"]
    assert fresh(run).output is None


def test_an_intact_chain_lets_the_same_run_succeed():
    run = start_workflow_run("kernel.tamper", {"key": "go"})
    DomainRow.objects.create(key="go")
    run_to_end()
    assert fresh(run).status == "succeeded"


@pytest.mark.parametrize(
    ("start", "target"),
    [
        ("succeeded", "queued"),
        ("succeeded", "running"),
        ("canceled", "queued"),
        ("queued", "succeeded"),
        ("waiting", "succeeded"),
        ("failed", "succeeded"),
    ],
)
def test_illegal_status_transitions_are_refused_by_the_database(start, target):
    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    with pgtrigger.ignore("k2b_workflows.WorkflowRun:status_transitions"):
        WorkflowRun.objects.filter(pk=run.pk).update(status=start)
    _refused("UPDATE k2b_run SET status = %s WHERE id = %s", [target, run.pk])
    assert fresh(run).status == start


def test_a_legal_status_transition_is_accepted():
    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    WorkflowRun.objects.filter(pk=run.pk).update(status="canceled")
    assert fresh(run).status == "canceled"


def _trigger_functions_called(cursor) -> set[str]:
    """The triggers whose functions this transaction called (a call that raised too)."""
    cursor.execute(
        "SELECT regexp_replace(funcname, '^pgtrigger_(.*)_[0-9a-f]{5}$', '\\1')"
        " FROM pg_stat_xact_user_functions WHERE funcname LIKE 'pgtrigger\\_%%'"
    )
    return {name for (name,) in cursor.fetchall()}


def test_a_claim_and_an_end_call_no_trigger_function():
    """The allowed transitions are listed in the status trigger's WHEN clause, and an
    end tries its waiters' lock in notify_ended's: a claim and an end nobody waits on
    call no PL/pgSQL function. Each call (with its pinned search_path and pgtrigger's
    ignore checks) cost some 30 µs of the server's CPU, a quarter of a no-op task's.
    A refused transition and an awaited end still call theirs."""
    import psycopg

    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    waited = start_workflow_run("test.pure", {"a": 1, "b": 2})
    update = "UPDATE k2b_run SET status = %s WHERE id = %s"
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as waiter:
        assert waiter.execute(results_module._WAIT_ON_SQL, [str(waited.pk)]).fetchone()[0]
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL track_functions = 'pl'")
            for status in ("running", "succeeded"):
                cursor.execute(update, [status, run.pk])
            assert _trigger_functions_called(cursor) == set()

            with pytest.raises(DatabaseError, match="Invalid transition"), transaction.atomic():
                cursor.execute(update, ["queued", run.pk])
            assert _trigger_functions_called(cursor) == {"status_transitions"}

            for status in ("running", "succeeded"):
                cursor.execute(update, [status, waited.pk])
            assert _trigger_functions_called(cursor) == {"status_transitions", "notify_ended"}
    assert (fresh(run).status, fresh(waited).status) == ("succeeded", "succeeded")


def test_generation_never_decreases():
    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    WorkflowRun.objects.filter(pk=run.pk).update(generation=5)
    _refused("UPDATE k2b_run SET generation = 4 WHERE id = %s", [run.pk])
    assert fresh(run).generation == 5
