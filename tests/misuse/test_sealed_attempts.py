"""How often a step may run again is the key holder's: retry counters and requeues (#47).

A review, as the runtime role (SQL only, no evidence key), set a run's
``consecutive_failures`` back to 0 while it waited for its retry: a workflow
step bounded to 3 attempts was called 213 times in 10 s, an EXTERNAL task that
charged and raised 106 times, and ``verifyworkflows`` saw nothing. It moved a
failed run back to ``queued``: 3 more calls. Here the same attacks run against
a live worker (a subprocess, as the owner: the key holder) and the calls are
counted in ``ProviderCall``; the attacker also moves ``run_after`` (which it
may) so that an hour of backoff takes no time.
"""

from __future__ import annotations

import time

import pytest
from django.db import DatabaseError, connection

from k2b_workflows import codes, retry_workflow_run, start_workflow_run
from k2b_workflows.kernel import db
from k2b_workflows.models import WorkflowRun
from tests.models import ProviderCall
from tests.support import runtime_role
from tests.support.admin import make_user
from tests.support.misuse import verify
from tests.support.processes import wait_for
from tests.support.runtime_role import RUNTIME, as_runtime, refused
from tests.tasks_app import tasks

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=["default", RUNTIME]),
    pytest.mark.crash,
]

runtime = runtime_role.runtime

#: More calls than any bound here allows: past it, the attack has won.
TOO_MANY = 6


def calls(action: str) -> int:
    return ProviderCall.objects.filter(action=action).count()


def row(run_id) -> WorkflowRun:
    return WorkflowRun.objects.get(pk=run_id)


def attack_until_settled(run_id, action: str, statement: str) -> tuple[int, int]:
    """As the runtime role, whenever the run waits for its retry: run ``statement`` (the
    reset) and make the run due at once. Until the run settles, or it has made more
    calls than any bound allows. Returns (resets refused, resets that went through)."""
    refusals = accepted = 0
    seen = -1
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and calls(action) < TOO_MANY:
        run = row(run_id)
        if run.status in ("succeeded", "failed", "canceled", "needs_attention"):
            break
        # Once per wait for a retry: each follows a claim of its own (a generation).
        if run.status == "queued" and run.consecutive_failures and run.generation != seen:
            seen = run.generation
            try:
                as_runtime(statement, [run_id])
                accepted += 1
            except DatabaseError as exc:
                assert db.sqlstate(exc) == "42501", exc
                refusals += 1
            as_runtime("UPDATE k2b_run SET run_after = k2b_now() WHERE id = %s", [run_id])
        time.sleep(0.02)
    return refusals, accepted


RESET = "UPDATE k2b_run SET consecutive_failures = 0 WHERE id = %s"
#: The reset with a number of its own: the database takes it, no key sealed it.
FORGED = (
    "UPDATE k2b_run SET consecutive_failures = 0, attempts_seq = attempts_seq + 1 WHERE id = %s"
)

CASES = {
    "workflow step": (lambda: start_workflow_run("callers.raises_hourly", {}).pk, "callers.raises"),
    "external task": (
        lambda: tasks.charge_then_raise.enqueue(7).id,
        "task.charge_then_raise",
    ),
}


def attacked(start_worker, case: str, statement: str, settles_as: str):
    """Start ``case`` on a live worker, attack each wait for its retry with ``statement``
    until the run settles as ``settles_as``: (the run, its action, refusals, accepted)."""
    start, action = CASES[case]
    run_id = start()
    worker = start_worker("--concurrency", "1")
    refusals, accepted = attack_until_settled(run_id, action, statement)
    wait_for(
        lambda: row(run_id).status == settles_as,
        timeout=60,
        message=lambda: f"{row(run_id).status}\n{worker.report()}",
    )
    return row(run_id), action, refusals, accepted


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_failure_count_set_back_by_the_runtime_role_is_refused_and_the_bound_holds(
    runtime, start_worker, case
):
    run, action, refusals, accepted = attacked(start_worker, case, RESET, "failed")
    assert (run.error_code, calls(action)) == (codes.WORKFLOW_RETRY_EXHAUSTED, 3)
    assert (refusals, accepted) == (2, 0)
    assert str(run.pk) not in verify()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_reset_forged_under_a_number_of_its_own_stops_the_run_at_its_claim(
    runtime, start_worker, case
):
    run, action, refusals, accepted = attacked(start_worker, case, FORGED, "needs_attention")
    assert run.error_code == codes.INTEGRITY_CHAIN_BROKEN
    assert "failure count" in run.error_message
    # The first attempt, and none after the forged reset.
    assert (calls(action), refusals, accepted) == (1, 0, 1)
    report = verify()
    assert str(run.pk) in report and "failure count" in report, report


def test_a_failed_run_is_queued_again_only_by_an_operator(runtime, start_worker):
    # Bounded to one attempt: it fails at its first failure, and its row still counts
    # none (the count is written by a retry, and there was none).
    run_id = start_workflow_run("callers.one_shot", {"ok_at": 5}).pk
    worker = start_worker("--concurrency", "1")
    wait_for(lambda: row(run_id).status == "failed", timeout=60, message=worker.report)
    assert (row(run_id).consecutive_failures, calls("callers.one_shot")) == (0, 1)
    # Back in line as the runtime role, its count untouched: refused as written (it
    # would run the action again).
    requeue = "status = 'queued', end_seal = '', finished_at = NULL, run_after = k2b_now()"
    refused(f"UPDATE k2b_run SET {requeue} WHERE id = %s", [run_id])
    # ...and under a number of its own, refused at the claim: no call more.
    as_runtime(
        f"UPDATE k2b_run SET {requeue}, attempts_seq = attempts_seq + 1 WHERE id = %s", [run_id]
    )
    wait_for(lambda: row(run_id).status == "needs_attention", timeout=60, message=worker.report)
    assert row(run_id).error_code == codes.INTEGRITY_CHAIN_BROKEN
    assert calls("callers.one_shot") == 1
    # The operator's retry goes through the kernel, which seals its own number: one
    # more attempt under the policy, as after any retry.
    olga = make_user("olga", "view_workflowrun", "retry_workflowrun")
    retry_workflow_run(run_id, actor=olga, reason="provider fixed")
    wait_for(lambda: row(run_id).status == "failed", timeout=60, message=worker.report)
    assert (row(run_id).error_code, calls("callers.one_shot")) == (
        codes.WORKFLOW_RETRY_EXHAUSTED,
        2,
    )
    assert str(run_id) not in verify()


def test_a_completed_step_resets_the_count_through_the_kernel():
    """The legitimate reset: failures before a completed step no longer count, as
    before #47; the row's new number carries the kernel's seal."""
    from k2b_workflows.testing import controlled_clock, run_until_idle

    with controlled_clock():
        run = start_workflow_run("callers.flaky_then_patient", {"ok_at": 3})
        run_until_idle()
    run.refresh_from_db()
    assert run.status == "succeeded", (run.error_code, run.error_message)
    # Two failures, the first step, one failure: the second step had its whole
    # policy, and one reset was sealed.
    assert (calls("callers.flaky"), calls("callers.patient")) == (3, 2)
    assert run.attempts_seq == 1
    assert run.attempts_seal
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM k2b_run WHERE attempts_seq > 0")
        assert cursor.fetchone()[0] == 1
    assert str(run.pk) not in verify()


def test_the_number_of_resets_never_goes_back(runtime):
    run = start_workflow_run("callers.raises_hourly", {})
    # The owner plays the kernel here: a number and a count the kernel wrote.
    WorkflowRun.objects.filter(pk=run.pk).update(attempts_seq=5, consecutive_failures=2)
    refused("UPDATE k2b_run SET attempts_seq = 4 WHERE id = %s", [run.pk])
    refused("UPDATE k2b_run SET consecutive_failures = 1 WHERE id = %s", [run.pk])
    # Raising the count only ends retries sooner: the runtime role may.
    as_runtime("UPDATE k2b_run SET consecutive_failures = 3 WHERE id = %s", [run.pk])
