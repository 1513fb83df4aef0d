"""Every row of DESIGN.md's effect-class table, executed in-process on the real PostgreSQL."""

from __future__ import annotations

import json

import pytest

from k2b_workflows import start_workflow_run
from k2b_workflows.models import BudgetCharge, JournalEntry, LedgerEntry
from k2b_workflows.store import (
    APPROVAL_REQUIRED,
    BACKUP_REQUIRED,
    EFFECT_OUTCOME_UNKNOWN,
    FORBIDDEN,
    INVALID_ACTION_RESULT,
)
from tests.models import DomainRow, ProviderCall
from tests.support.kernel import describe, expire_lease, fresh, journal, ledger_kinds, run_to_end
from tests.workflows import kernel as workflows_kernel

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _clean_probes():
    workflows_kernel.ATTEMPTS.clear()
    workflows_kernel.OBSERVED.clear()
    yield


def calls(action: str) -> list[ProviderCall]:
    return list(ProviderCall.objects.filter(action=action).order_by("id"))


# -- PURE -------------------------------------------------------------------


def test_pure_retryable_failure_runs_the_step_again():
    run = start_workflow_run("test.flaky", {"times": 2})
    run_to_end()
    assert describe(run)["status"] == "succeeded"
    assert fresh(run).output == {"attempts": 3}
    assert len(calls("test.flaky")) == 3


def test_pure_exception_is_retried():
    run = start_workflow_run("test.flaky", {"times": 1, "how": "raise"})
    run_to_end()
    assert fresh(run).output == {"attempts": 2}


# -- TRANSACTIONAL ----------------------------------------------------------


def test_transactional_exception_rolls_back_the_row_with_the_journal_entry_and_retries():
    run = start_workflow_run("kernel.tx_probe", {"key": "t", "fail_times": 1})
    run_to_end()
    assert describe(run)["status"] == "succeeded"
    # Attempt 1 wrote "t:1" and raised: that row went with the rolled-back block.
    assert list(DomainRow.objects.values_list("key", flat=True)) == ["t:2"]
    entries = journal(run)
    assert [(e.seq, e.state, e.output) for e in entries] == [(0, "succeeded", {"attempt": 2})]


def test_transactional_ctx_tx_is_the_kernels_atomic_block_fenced_when_it_journals():
    """The run row is locked by the statement that journals the step, after ``run()``:
    while the action runs, the lease keeper, a cancel or a wake do not wait on it."""
    run = start_workflow_run("kernel.tx_probe", {"key": "probe"})
    run_to_end()
    facts = DomainRow.objects.get(key="probe:1").value
    assert facts["using"] == "default"
    assert facts["atomic"] is True
    assert facts["is_atomic_block"] is True
    assert facts["run_row_locked"] is False, "the fence goes with the journal statement"
    assert fresh(run).status == "succeeded"


def test_transactional_invalid_result_fails_the_run_and_commits_nothing_of_the_step():
    run = start_workflow_run("kernel.tx_probe", {"key": "bad", "bad": "not_a_result"})
    run_to_end()
    state = describe(run)
    assert (state["status"], state["code"]) == ("failed", INVALID_ACTION_RESULT)
    assert not DomainRow.objects.exists()


def test_transactional_non_json_output_is_an_invalid_result():
    run = start_workflow_run("kernel.tx_probe", {"key": "nj", "bad": "non_json"})
    run_to_end()
    assert describe(run)["code"] == INVALID_ACTION_RESULT
    assert not DomainRow.objects.exists()


def test_transactional_authorize_denial_fails_forbidden_and_writes_nothing():
    run = start_workflow_run("kernel.tx_denied", {})
    stats = run_to_end()
    assert (describe(run)["status"], describe(run)["code"]) == ("failed", FORBIDDEN)
    assert not DomainRow.objects.exists()
    assert stats["runs"] == 1


# -- IDEMPOTENT -------------------------------------------------------------


def test_idempotent_budget_charge_is_committed_before_run():
    run = start_workflow_run("kernel.idem_probe", {})
    run_to_end()
    (call,) = calls("kernel.idem_probe")
    assert call.payload["charged_before_run"] == 1
    assert BudgetCharge.objects.filter(run=run).count() == 1


def test_idempotent_retries_keep_the_effect_key_and_pay_once():
    run = start_workflow_run("kernel.idem_probe", {"fail_times": 2})
    run_to_end()
    assert fresh(run).status == "succeeded"
    keys = {c.effect_key for c in calls("kernel.idem_probe")}
    assert len(calls("kernel.idem_probe")) == 3
    assert keys == {f"{run.pk}:0"}
    assert fresh(run).output == {"effect_key": f"{run.pk}:0"}
    assert BudgetCharge.objects.filter(run=run).count() == 1


def test_idempotent_fenced_write_refuses_a_stale_generation():
    run = start_workflow_run("kernel.idem_stale", {})
    run_to_end()
    refused = [o for o in workflows_kernel.OBSERVED if "refused_generation" in o]
    assert len(refused) == 1 and "no longer holds the lease" in refused[0]["error"]
    stale = refused[0]["refused_generation"]
    assert not DomainRow.objects.filter(key=f"stale:{stale}").exists()
    # The run is not lost: when the lease of the generation that took over expires
    # (nothing executes it in this test), a later claim finishes it.
    assert fresh(run).status == "running"
    expire_lease(run)
    run_to_end()
    done = fresh(run)
    assert done.status == "succeeded"
    assert DomainRow.objects.filter(key=f"stale:{done.output['generation']}").count() == 1
    assert done.output["generation"] > stale


# -- EXTERNAL ---------------------------------------------------------------


SECRET = "4242-4242-SECRET-CARD"


def test_external_dispatched_entry_with_evidence_hashes_exists_before_the_provider_call():
    run = start_workflow_run(
        "kernel.external_probe",
        {"card": SECRET},
        idempotency_key="order-1",
        principal={"user": 7, "token": SECRET},
    )
    run_to_end()
    (attempt,) = calls("kernel.external_probe.attempt")
    (seen,) = attempt.payload["dispatched_before_run"]
    assert seen["invocation_key"] == f"{run.pk}:0:1"
    assert seen["effect_key"] == f"{run.pk}:0"
    for field in (
        "definition_hash",
        "input_hash",
        "preview_hash",
        "principal_hash",
        "idempotency_key_hash",
    ):
        assert len(seen[field]) == 64, field
    assert fresh(run).status == "succeeded"


def test_external_ledger_never_holds_raw_input_or_principal():
    run = start_workflow_run(
        "kernel.external_probe",
        {"card": SECRET},
        idempotency_key=f"key-{SECRET}",
        principal={"token": SECRET},
    )
    run_to_end()
    rows = list(LedgerEntry.objects.filter(run=run).values())
    assert rows
    assert SECRET not in json.dumps(rows, default=str)


@pytest.mark.parametrize("behaviour", ["raise", "ambiguous", "invalid", "non_json"])
def test_external_doubt_after_dispatch_reconciles_and_never_runs_again(behaviour):
    run = start_workflow_run("test.charge", {"amount": 5, "behaviour": behaviour})
    run_to_end()
    done = fresh(run)
    assert done.status == "succeeded", describe(run)
    assert done.output["reconciled"] is True
    assert len(calls("test.charge")) == 1
    kinds = ledger_kinds(run)
    assert kinds.count("dispatched") == 1
    assert "outcome_unknown" in kinds and "reconciled" in kinds


@pytest.mark.parametrize("behaviour", ["raise", "ambiguous", "invalid", "non_json"])
def test_external_doubt_without_reconcile_needs_attention(behaviour):
    run = start_workflow_run("test.charge_blind", {"amount": 5, "behaviour": behaviour})
    run_to_end()
    done = fresh(run)
    assert (done.status, done.error_code) == ("needs_attention", EFFECT_OUTCOME_UNKNOWN)
    assert done.attention_step == 0
    assert len(calls("test.charge_blind")) == 1
    assert not JournalEntry.objects.filter(run=run).exists()


def test_external_reconcile_unknown_needs_attention():
    run = start_workflow_run("test.charge", {"behaviour": "raise", "reconcile": "unknown"})
    run_to_end()
    assert describe(run)["code"] == EFFECT_OUTCOME_UNKNOWN
    assert "reconcile_unknown" in ledger_kinds(run)
    assert len(calls("test.charge")) == 1


def test_external_reconciled_absent_fails_the_step_and_never_runs_it_again():
    # A lookup can lag behind the provider's writes: "not found" after doubt is no proof,
    # so only an operator's "effect absent" may run the step again (see test_control).
    run = start_workflow_run("kernel.external_probe", {"lost_first": True})
    stats = run_to_end()
    state = describe(run)
    assert (state["status"], state["code"]) == ("failed", "ACTION_FAILED")
    dispatched = LedgerEntry.objects.filter(run=run, kind="dispatched")
    assert [d.invocation_key for d in dispatched] == [f"{run.pk}:0:1"]
    assert len(calls("kernel.external_probe.attempt")) == 1
    assert [c.invocation_key for c in calls("kernel.external_probe.reconcile")] == [f"{run.pk}:0:1"]
    assert stats["runs"] == 1


@pytest.mark.parametrize(
    ("effect", "value", "message"),
    [
        ("EXTERNAL", "yes", "redispatch_when_absent must be True or False, not 'yes'"),
        ("IDEMPOTENT", True, "redispatch_when_absent applies to EXTERNAL, .* not IDEMPOTENT"),
    ],
)
def test_redispatch_when_absent_is_refused_where_it_would_mean_nothing(effect, value, message):
    from k2b_workflows import Action, Effect
    from k2b_workflows.exceptions import InvalidInput

    with pytest.raises(InvalidInput, match=message):
        type(
            "Misdeclared",
            (Action,),
            {
                "name": "tests.misdeclared",
                "effect": Effect[effect],
                "redispatch_when_absent": value,
            },
        )


def test_external_failure_before_effect_is_a_step_failure_the_workflow_can_catch():
    run = start_workflow_run("test.catches", {})
    run_to_end()
    assert fresh(run).status == "succeeded"
    assert fresh(run).output == {"caught": "CARD_DECLINED"}


# -- IRREVERSIBLE and SNAPSHOT_RESTORE ----------------------------------------


def test_irreversible_without_approval_ref_is_rejected_before_any_provider_call():
    run = start_workflow_run("test.irreversible", {})
    run_to_end()
    assert describe(run)["code"] == APPROVAL_REQUIRED
    assert not calls("test.delete_account")
    assert "dispatched" not in ledger_kinds(run)


def test_irreversible_with_approval_ref_dispatches_with_the_ref_as_evidence():
    run = start_workflow_run("test.irreversible", {"approval_ref": "CAB-17"})
    run_to_end()
    assert fresh(run).status == "succeeded"
    assert len(calls("test.delete_account")) == 1
    dispatched = LedgerEntry.objects.get(run=run, kind="dispatched")
    assert dispatched.detail == {"approval_ref": "CAB-17"}


def test_snapshot_restore_without_backup_ref_is_rejected_before_any_provider_call():
    run = start_workflow_run("test.restore", {})
    run_to_end()
    assert describe(run)["code"] == BACKUP_REQUIRED
    assert not calls("test.restore_snapshot")


def test_snapshot_restore_with_backup_ref_runs():
    run = start_workflow_run("test.restore", {"backup_ref": "snap-2024-01-01"})
    run_to_end()
    assert fresh(run).status == "succeeded"
    assert len(calls("test.restore_snapshot")) == 1


# -- authorize() --------------------------------------------------------------


@pytest.mark.parametrize("deny", ["raise", "result"])
def test_authorize_denial_fails_forbidden_without_calling_the_provider_or_retrying(deny):
    run = start_workflow_run("test.guarded", {"deny": deny})
    stats = run_to_end()
    state = describe(run)
    assert (state["status"], state["code"]) == ("failed", FORBIDDEN)
    assert not calls("test.guarded")
    assert stats["runs"] == 1 and state["failures"] == 0
    assert "dispatched" not in ledger_kinds(run)


# -- invalid results ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["not_a_result", "non_json"])
def test_pure_invalid_result_fails_invalid_action_result(kind):
    run = start_workflow_run("test.bad_result", {"kind": kind})
    stats = run_to_end()
    assert describe(run)["code"] == INVALID_ACTION_RESULT
    assert stats["runs"] == 1
    (entry,) = journal(run)
    assert (entry.state, entry.error_code) == ("failed", INVALID_ACTION_RESULT)


def test_non_json_workflow_output_fails_the_run():
    run = start_workflow_run("test.non_json_output", {})
    run_to_end()
    state = describe(run)
    assert state["status"] == "failed"
    assert "JSON" in state["message"]
