"""Less travelled kernel paths: heartbeats from actions, hooks that fail, charges in a tx."""

from __future__ import annotations

import pytest

from k2b_workflows import start_workflow_run
from k2b_workflows.models import BudgetCharge, JournalEntry, LedgerEntry
from k2b_workflows.store import EFFECT_BUDGET_EXCEEDED, EFFECT_OUTCOME_UNKNOWN
from k2b_workflows.testing import run_until_idle
from tests.models import DomainRow, ProviderCall
from tests.support.kernel import assert_closed_as_never_sent, expire_lease, fresh

pytestmark = pytest.mark.django_db(transaction=True)


def notes() -> list[str]:
    return [c.payload["what"] for c in ProviderCall.objects.filter(action="edges.heartbeat")]


def test_heartbeat_without_tx_renews_the_lease():
    run = start_workflow_run("edges.heartbeat", {"mode": "renew"})
    run_until_idle()
    assert fresh(run).output == {"renewed": True}


def test_heartbeat_after_a_takeover_raises_lease_lost_and_nothing_commits():
    run = start_workflow_run("edges.heartbeat", {"mode": "takeover"})
    run_until_idle()
    assert notes() == ["LeaseLost"]
    stale = fresh(run)
    assert stale.status == "running"  # the takeover's owner: this test, which never finishes
    assert not JournalEntry.objects.filter(run=run).exists()

    expire_lease(run)
    run_until_idle()
    done = fresh(run)
    assert done.status == "succeeded"
    assert done.generation > stale.generation
    (entry,) = JournalEntry.objects.filter(run=run)
    assert entry.generation == done.generation


def test_heartbeat_after_cancel_raises_run_canceled():
    run = start_workflow_run("edges.heartbeat", {"mode": "cancel"})
    run_until_idle()
    assert notes() == ["RunCanceled"]
    assert fresh(run).status == "canceled"
    assert not JournalEntry.objects.filter(run=run).exists()


def test_heartbeat_names_the_wrong_database():
    run = start_workflow_run("edges.heartbeat", {"mode": "bad_alias"})
    run_until_idle()
    assert "elsewhere" in fresh(run).output["refused"]


def test_heartbeat_without_tx_is_refused_while_the_run_lock_is_held():
    run = start_workflow_run("edges.heartbeat_in_tx", {})
    run_until_idle()
    done = fresh(run)
    assert done.status == "succeeded"
    assert "holds the run lock" in done.output["refused"]


def test_a_transactional_step_over_budget_writes_nothing():
    run = start_workflow_run("edges.costly_writes", {})
    run_until_idle()
    done = fresh(run)
    assert (done.status, done.error_code) == ("failed", EFFECT_BUDGET_EXCEEDED)
    assert list(DomainRow.objects.values_list("key", flat=True)) == ["first"]
    assert list(BudgetCharge.objects.values_list("seq", "amount")) == [(0, 1)]


def test_reconcile_that_raises_hands_the_step_to_an_operator():
    run = start_workflow_run("test.charge", {"behaviour": "raise", "reconcile": "raise"})
    run_until_idle()
    done = fresh(run)
    assert (done.status, done.error_code, done.attention_step) == (
        "needs_attention",
        EFFECT_OUTCOME_UNKNOWN,
        0,
    )
    last = LedgerEntry.objects.filter(run=run).order_by("id").last()
    assert last.kind == "reconcile_unknown"
    assert "ConnectionError" in last.message
    assert ProviderCall.objects.filter(action="test.charge").count() == 1


def test_authorize_that_fails_unexpectedly_is_retried_before_any_effect():
    run = start_workflow_run("edges.broken_authorize", {})
    run_until_idle()
    done = fresh(run)
    assert done.status == "succeeded"
    assert ProviderCall.objects.filter(action="edges.authorize").count() == 3
    assert ProviderCall.objects.filter(action="edges.broken_authorize").count() == 1
    # Two failed authorizations dispatched nothing: one invocation in the ledger.
    assert LedgerEntry.objects.filter(run=run, kind="dispatched").count() == 1


def test_authorize_returning_garbage_fails_the_run_before_any_effect():
    run = start_workflow_run("edges.broken_authorize", {"garbage": True})
    run_until_idle()
    done = fresh(run)
    assert (done.status, done.error_code) == ("failed", "INVALID_ACTION_RESULT")
    assert not ProviderCall.objects.filter(action="edges.broken_authorize").exists()
    assert not LedgerEntry.objects.filter(run=run, kind="dispatched").exists()


def test_a_dispatch_whose_commit_answer_is_lost_is_closed_as_never_sent(monkeypatch):
    """The server commits the dispatch, the client never hears so: a new invocation, no incident.

    Fault injection, not a mock: the COMMIT really happens, then the client's
    connection reports an error, as when a network drops COMMIT's answer.
    """
    from django.db import OperationalError
    from django.db.backends.postgresql.base import DatabaseWrapper

    from k2b_workflows.kernel import evidence

    state = {"dispatch_in_transaction": False, "cut": 0}
    append_ledger, commit = evidence.append_ledger, DatabaseWrapper._commit

    def spy_append_ledger(using, **fields):
        entry = append_ledger(using, **fields)
        if fields["kind"] == "dispatched" and not state["cut"]:
            state["dispatch_in_transaction"] = True
        return entry

    def commit_then_lose_the_answer(self):
        commit(self)
        if state["dispatch_in_transaction"]:
            state["dispatch_in_transaction"] = False
            state["cut"] += 1
            raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(evidence, "append_ledger", spy_append_ledger)
    monkeypatch.setattr(DatabaseWrapper, "_commit", commit_then_lose_the_answer)

    run = start_workflow_run("test.charge_blind", {"amount": 7})
    run_until_idle()

    assert state["cut"] == 1
    done = fresh(run)
    assert done.status == "succeeded", (done.error_code, done.error_message)
    assert ProviderCall.objects.filter(action="test.charge_blind").count() == 1
    assert_closed_as_never_sent(run)
