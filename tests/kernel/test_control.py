"""The control API with bad input loses nothing; operators' decisions do what they say."""

from __future__ import annotations

import threading

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.db import connections

from k2b_workflows import (
    EFFECT_ABSENT,
    EFFECT_CONFIRMED,
    cancel_workflow_run,
    resolve_effect,
    start_workflow_run,
)
from k2b_workflows.control import retry_workflow_run
from k2b_workflows.exceptions import (
    InvalidInput,
    NotRetryable,
    ResolutionRefused,
    UnknownWorkflow,
)
from k2b_workflows.models import BudgetAccount, JournalEntry, LedgerEntry, WorkflowRun
from k2b_workflows.store import EFFECT_OUTCOME_UNKNOWN
from tests.models import ProviderCall
from tests.support.admin import user_with
from tests.support.kernel import describe, exhausted_run, fresh, journal, ledger_kinds, run_to_end

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def resolver() -> User:
    """Holds the two permissions of control's interventions, and no view of the admin."""
    return user_with("resolve_effect", "retry_workflowrun")


@pytest.fixture
def doubted_run() -> WorkflowRun:
    """A run in needs_attention: its first charge's answer was lost, no reconcile()."""
    run = start_workflow_run("kernel.blind_once", {})
    run_to_end()
    assert describe(run)["code"] == EFFECT_OUTCOME_UNKNOWN
    return run


# -- start_workflow_run ------------------------------------------------------------


def test_an_unknown_workflow_is_a_clear_error_that_creates_nothing():
    with pytest.raises(UnknownWorkflow, match=r"no\.such"):
        start_workflow_run("no.such", {})
    assert not WorkflowRun.objects.exists() and not BudgetAccount.objects.exists()


@pytest.mark.parametrize("bad", [{"when": object()}, {1, 2}, float("nan")])
def test_non_json_input_is_invalid_and_creates_nothing(bad):
    with pytest.raises(InvalidInput):
        start_workflow_run("test.pure", bad)
    assert not WorkflowRun.objects.exists()


def test_the_same_idempotency_key_returns_the_same_run():
    first = start_workflow_run("test.pure", {"a": 1, "b": 2}, idempotency_key="order-9")
    again = start_workflow_run("test.pure", {"a": 1, "b": 2}, idempotency_key="order-9")
    assert again.pk == first.pk
    assert WorkflowRun.objects.count() == 1


def test_concurrent_starts_with_one_idempotency_key_create_one_run():
    barrier = threading.Barrier(8)
    results: list = []

    def start() -> None:
        try:
            barrier.wait()
            results.append(
                start_workflow_run("test.pure", {"a": 1, "b": 2}, idempotency_key="same")
            )
        except BaseException as exc:  # collected, asserted below
            results.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert len({r.pk for r in results}) == 1
    assert WorkflowRun.objects.count() == 1 and BudgetAccount.objects.count() == 1


# -- resolve_effect ----------------------------------------------------------------


def test_resolve_is_refused_on_a_run_that_needs_no_decision(resolver):
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    with pytest.raises(ResolutionRefused):
        resolve_effect(run.pk, EFFECT_CONFIRMED, evidence="looked", actor=resolver, output={})
    assert fresh(run).status == "queued"
    assert not LedgerEntry.objects.filter(run=run).exists()


@pytest.mark.parametrize("evidence", ["", "   "])
def test_resolve_needs_evidence_text(doubted_run, resolver, evidence):
    with pytest.raises(InvalidInput):
        resolve_effect(doubted_run.pk, EFFECT_ABSENT, evidence=evidence, actor=resolver)
    assert fresh(doubted_run).status == "needs_attention"


def test_resolve_needs_the_resolve_effect_permission(doubted_run):
    clerk = user_with("retry_workflowrun", name="clerk")
    with pytest.raises(PermissionDenied):
        resolve_effect(doubted_run.pk, EFFECT_ABSENT, evidence="checked", actor=clerk)
    assert fresh(doubted_run).status == "needs_attention"
    assert "resolved_absent" not in ledger_kinds(doubted_run)


def test_effect_confirmed_advances_without_calling_the_provider(doubted_run, resolver):
    resolve_effect(
        doubted_run.pk,
        EFFECT_CONFIRMED,
        evidence="gateway shows it",
        actor=resolver,
        output={"sent": "by hand"},
    )
    run_to_end()
    done = fresh(doubted_run)
    assert done.status == "succeeded", describe(done)
    assert done.output == {"sent": "by hand"}
    assert ProviderCall.objects.filter(action="kernel.blind_once").count() == 1
    step0 = journal(doubted_run)[0]
    assert step0.output == {"sent": "by hand"}
    confirmed = LedgerEntry.objects.get(run=doubted_run, kind="resolved_confirmed")
    assert (confirmed.actor, confirmed.evidence) == ("op", "gateway shows it")


def test_effect_absent_reruns_the_step_under_a_new_invocation_key_and_the_same_effect_key(
    doubted_run, resolver
):
    resolve_effect(doubted_run.pk, EFFECT_ABSENT, evidence="not in the gateway", actor=resolver)
    assert fresh(doubted_run).status == "queued"
    run_to_end()
    done = fresh(doubted_run)
    assert done.status == "succeeded", describe(done)
    calls = ProviderCall.objects.filter(action="kernel.blind_once").order_by("id")
    assert [c.invocation_key for c in calls] == [f"{done.pk}:0:1", f"{done.pk}:0:2"]
    assert {c.effect_key for c in calls} == {f"{done.pk}:0"}
    assert done.output == {"sent": f"{done.pk}:0:2"}


def test_a_confirmed_output_must_be_json(doubted_run, resolver):
    with pytest.raises(InvalidInput):
        resolve_effect(
            doubted_run.pk,
            EFFECT_CONFIRMED,
            evidence="seen",
            actor=resolver,
            output={"at": object()},
        )
    assert not JournalEntry.objects.filter(run=doubted_run).exists()


def test_a_confirmation_without_an_output_is_refused_and_writes_nothing(doubted_run, resolver):
    """As in the admin and ``workflowrun resolve``: no default output is journaled (#38)."""
    with pytest.raises(InvalidInput, match="EFFECT_CONFIRMED needs output="):
        resolve_effect(doubted_run.pk, EFFECT_CONFIRMED, evidence="seen", actor=resolver)
    assert fresh(doubted_run).status == "needs_attention"
    assert not JournalEntry.objects.filter(run=doubted_run).exists()
    assert "resolved_confirmed" not in ledger_kinds(doubted_run)


def test_a_confirmed_output_of_none_is_journaled_when_passed(doubted_run, resolver):
    resolve_effect(doubted_run.pk, EFFECT_CONFIRMED, evidence="seen", actor=resolver, output=None)
    run_to_end()
    assert fresh(doubted_run).status == "succeeded", describe(doubted_run)
    assert journal(doubted_run)[0].output is None
    assert "resolved_confirmed" in ledger_kinds(doubted_run)


# -- retry_workflow_run ------------------------------------------------------------


def test_retry_requeues_a_run_that_exhausted_its_retries(resolver):
    run = exhausted_run()
    retried = retry_workflow_run(run.pk, actor=resolver, reason="provider is back")
    assert (retried.status, retried.consecutive_failures) == ("queued", 0)
    assert "retried" in ledger_kinds(run)


def test_retry_refuses_a_run_that_failed_on_a_journaled_step():
    run = start_workflow_run("test.bad_result", {})
    run_to_end()
    with pytest.raises(NotRetryable):
        retry_workflow_run(run.pk, actor=user_with("retry_workflowrun"))
    assert fresh(run).status == "failed"


def test_retry_refuses_a_run_that_is_not_failed(resolver):
    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    with pytest.raises(NotRetryable):
        retry_workflow_run(run.pk, actor=resolver)


def test_retry_needs_its_permission():
    run = exhausted_run()
    with pytest.raises(PermissionDenied):
        retry_workflow_run(run.pk, actor=user_with("resolve_effect"))
    assert fresh(run).status == "failed"


# -- cancel_workflow_run -----------------------------------------------------------


def test_cancel_ends_a_queued_run_with_evidence():
    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    canceled = cancel_workflow_run(run.pk, "customer asked")
    assert (canceled.status, canceled.error_code) == ("canceled", "CANCELED")
    assert ledger_kinds(run) == ["canceled"]
    assert run_to_end()["runs"] == 0


def test_cancel_needs_a_reason():
    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    with pytest.raises(InvalidInput):
        cancel_workflow_run(run.pk, " ")
    assert fresh(run).status == "queued"


def test_cancel_leaves_a_finished_run_unchanged():
    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    run_to_end()
    assert cancel_workflow_run(run.pk, "too late").status == "succeeded"
    assert "canceled" not in ledger_kinds(run)
