"""Values produced inside a run that cannot be stored are step failures, never fake crashes.

Before, a NUL in an output escaped the executor as a ``DataError``: the run sat
in ``running`` until its lease expired, five times, and failed
``WORKFLOW_RETRY_EXHAUSTED`` blaming a crashed worker. And nothing that can
grow, grows without bound: AI attempts, provider polls, wake rows.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import override_settings

from k2b_workflows import start_workflow_run, wake_workflow_runs_waiting_on
from k2b_workflows.kernel import ai, waits
from k2b_workflows.models import AiTask, JournalEntry, LedgerEntry, WaitRendezvous, WorkflowRun
from k2b_workflows.store import (
    AI_TASK_FAILED,
    EFFECT_OUTCOME_UNKNOWN,
    INVALID_ACTION_RESULT,
    WORKFLOW_RETRY_EXHAUSTED,
)
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall

pytestmark = pytest.mark.django_db(transaction=True)


def produce(kind: str) -> WorkflowRun:
    run = start_workflow_run("misuse.produce", {"kind": kind})
    run_until_idle(timeout=60)
    run.refresh_from_db()
    return run


def test_an_output_with_nul_fails_the_step_invalid_action_result_at_once():
    run = produce("nul_output")
    assert (run.status, run.error_code) == ("failed", INVALID_ACTION_RESULT)
    assert "run() output['text'] contains a NUL character" in run.error_message
    assert run.generation == 1  # one claim: no lease expired, no retry
    assert "lease expired" not in run.error_message


def test_a_summary_with_nul_fails_the_step_cleanly():
    run = produce("nul_summary")
    assert (run.status, run.error_code, run.generation) == ("failed", INVALID_ACTION_RESULT, 1)
    assert "summary contains a NUL" in run.error_message


def test_a_failure_message_with_nul_is_stored_escaped():
    run = produce("nul_failure")
    assert (run.status, run.error_code, run.generation) == ("failed", "PROVIDER_SAID_NO", 1)
    assert run.error_message == "provider said \\x00"
    entry = JournalEntry.objects.get(run=run)
    assert entry.error_message == "provider said \\x00"


def test_a_failure_code_longer_than_its_column_is_an_invalid_result():
    run = produce("long_code")
    assert (run.status, run.error_code, run.generation) == ("failed", INVALID_ACTION_RESULT, 1)
    assert "code is 101 characters long, at most 100" in run.error_message


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("long_wait_key", "waiting() key is 501 characters long, at most 500"),
        ("nul_wait_key", "waiting() key contains a NUL"),
    ],
)
def test_a_wait_key_that_cannot_be_stored_is_an_invalid_result(kind, message):
    run = produce(kind)
    assert (run.status, run.error_code, run.generation) == ("failed", INVALID_ACTION_RESULT, 1)
    assert message in run.error_message


def test_an_exception_text_with_nul_is_retried_and_recorded_not_a_lease_expiry():
    run = produce("raise_nul")
    assert (run.status, run.error_code) == ("failed", WORKFLOW_RETRY_EXHAUSTED)
    # Each attempt was a retry recorded by the worker, not a lease that expired.
    assert "boom \\x00 here" in run.error_message
    assert "lease expired" not in run.error_message
    assert run.generation == 5


def test_an_external_answer_with_nul_keeps_the_evidence_and_needs_an_operator():
    run = start_workflow_run("misuse.external_nul", {"charge": 1})
    run_until_idle(timeout=60)
    run.refresh_from_db()
    assert (run.status, run.error_code) == ("needs_attention", EFFECT_OUTCOME_UNKNOWN)
    assert run.generation == 1
    kinds = list(LedgerEntry.objects.filter(run=run).order_by("id").values_list("kind", flat=True))
    assert kinds == ["dispatched", "outcome_unknown", "reconcile_unknown"]
    unknown = LedgerEntry.objects.get(run=run, kind="outcome_unknown")
    assert "contains a NUL" in unknown.message
    assert not JournalEntry.objects.filter(run=run).exists()


def test_an_ai_answer_with_nul_fails_the_step_ai_task_failed_after_one_call():
    run = start_workflow_run("misuse.ask_ai", {"provider": "misuse.nul_answer"})
    run_until_idle(timeout=60)
    run.refresh_from_db()
    assert (run.status, run.error_code) == ("failed", AI_TASK_FAILED)
    task = AiTask.objects.get(run=run)
    assert (task.status, task.attempts) == ("failed", 1)
    assert "contains a NUL" in task.error_message


def test_an_ai_error_text_with_nul_is_stored_escaped():
    run = start_workflow_run("misuse.ask_ai", {"provider": "misuse.nul_error"})
    run_until_idle(timeout=60)
    run.refresh_from_db()
    assert (run.status, run.error_code) == ("failed", AI_TASK_FAILED)
    assert AiTask.objects.get(run=run).error_message == "RuntimeError: quota \\x00 exceeded"


def test_an_ai_request_that_cannot_be_stored_fails_the_step_without_a_task():
    run = start_workflow_run(
        "misuse.ask_ai", {"provider": "misuse.nul_answer", "request": {"q": "fine"}}
    )
    # The request is produced inside the run: make it unstorable there.
    with override_settings(K2B_WORKFLOWS={"MAX_VALUE_BYTES": 5}):
        run_until_idle(timeout=60)
    run.refresh_from_db()
    assert (run.status, run.error_code) == ("failed", AI_TASK_FAILED)
    assert "the AI request is" in run.error_message
    assert not AiTask.objects.filter(run=run).exists()


@override_settings(K2B_WORKFLOWS={"AI_TASK_MAX_ATTEMPTS": 2, "RETRY_BACKOFF_MS": 50})
def test_an_ai_task_whose_worker_keeps_dying_fails_after_the_maximum_attempts():
    run = start_workflow_run("misuse.ask_ai", {"provider": "misuse.nul_answer"})
    _park_on_task(run)
    task = AiTask.objects.get(run=run)

    def crash_while_running() -> None:
        # What a worker killed inside the provider leaves: a claimed task, an expired lease.
        assert ai.claim_tasks("default", app_ids=None, limit=10)
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE k2b_ai_task SET lease_expires_at = now() - interval '1 second' "
                "WHERE id = %s",
                [task.pk],
            )
        ai.reap_expired("default")

    crash_while_running()
    task.refresh_from_db()
    assert (task.status, task.attempts) == ("queued", 1)
    crash_while_running()
    task.refresh_from_db()
    assert (task.status, task.attempts) == ("failed", 2)
    assert "gave up after 2 attempts" in task.error_message
    run_until_idle(timeout=60)
    run.refresh_from_db()
    assert (run.status, run.error_code) == ("failed", AI_TASK_FAILED)
    assert "gave up after 2 attempts" in run.error_message


def _park_on_task(run: WorkflowRun) -> None:
    """Execute the run until it waits on its AI task, leaving the task queued."""
    from tests.support.kernel import execute_once

    execute_once(run)
    run.refresh_from_db()
    assert run.status == "waiting"


@override_settings(K2B_WORKFLOWS={"MAX_RECONCILE_POLLS": 2, "RETRY_BACKOFF_MS": 50})
def test_a_provider_that_stays_pending_is_polled_a_bounded_number_of_times():
    run = start_workflow_run("test.payout", {"polls": 50, "every_ms": 10})
    run_until_idle(wait_for_deadlines=True, timeout=60)
    run.refresh_from_db()
    assert (run.status, run.error_code) == ("needs_attention", EFFECT_OUTCOME_UNKNOWN)
    assert "still pending after 2 polls" in run.error_message
    assert ProviderCall.objects.filter(action="payout.submit").count() == 1
    assert ProviderCall.objects.filter(action="payout.poll").count() == 3
    assert LedgerEntry.objects.filter(run=run, kind=LedgerEntry.Kind.PENDING).count() == 2


def test_wake_rows_nobody_waits_on_are_purged_after_the_retention():
    run = start_workflow_run("test.wait", {"key": "kept"})
    run_until_idle(timeout=60)
    run.refresh_from_db()
    assert run.status == "waiting", (run.status, run.error_message)
    for key in ("old", "recent"):
        wake_workflow_runs_waiting_on(app_id="tests", kind="misuse", key=key)
    hours_ago = "now() - interval '169 hours'"
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE k2b_wait SET signaled_at = {hours_ago}, created_at = {hours_ago} "
            "WHERE key IN ('old', %s)",
            [run.wait_key],
        )
    assert waits.purge_stale_rendezvous("default", force=True) == 1
    keys = set(WaitRendezvous.objects.values_list("key", flat=True))
    assert "old" not in keys
    assert {"recent", run.wait_key} <= keys  # too young; a run is parked on it
    # Housekeeping runs it at most once a minute per process.
    wake_workflow_runs_waiting_on(app_id="tests", kind="misuse", key="old")
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE k2b_wait SET signaled_at = {hours_ago} WHERE key = 'old'")
    assert waits.purge_stale_rendezvous("default") == 0
