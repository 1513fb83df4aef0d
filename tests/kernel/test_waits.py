"""Durable waits on real PostgreSQL: park, wake, deadlines, cancellation.

A run parks on ``(app_id, kind, key)``; ``wake_workflow_runs_waiting_on``
re-queues it, in whichever order the two commit. These tests drive the
in-process worker (``run_until_idle``) or a real ``runworkflows`` process.
"""

from __future__ import annotations

import pytest
from django.db import transaction

from k2b_workflows import (
    cancel_workflow_run,
    start_workflow_run,
    wake_workflow_runs_waiting_on,
)
from k2b_workflows.models import JournalEntry, WaitRendezvous, WorkflowRun
from k2b_workflows.store import max_consecutive_failures
from k2b_workflows.testing import run_until_idle
from tests.models import DomainRow, ProviderCall
from tests.workflows.waits import GATE_KIND, open_gate

pytestmark = pytest.mark.django_db(transaction=True)


def refresh(run: WorkflowRun) -> WorkflowRun:
    return WorkflowRun.objects.get(pk=run.pk)


def calls(run: WorkflowRun) -> list[ProviderCall]:
    return list(ProviderCall.objects.filter(effect_key__startswith=f"{run.pk}:").order_by("id"))


def park_gate(key: str, **extra) -> WorkflowRun:
    run = start_workflow_run("waits.gate", {"key": key, **extra})
    run_until_idle(app_ids=["tests"])
    run = refresh(run)
    assert run.status == "waiting"
    return run


def test_parked_run_records_what_it_waits_for():
    run = park_gate("order-1", deadline_s=3600)

    assert (run.wait_kind, run.wait_key) == (GATE_KIND, "order-1")
    assert run.waiting_since is not None
    assert run.wait_deadline is not None and run.wait_deadline > run.waiting_since


def test_woken_run_reruns_the_step_with_the_same_effect_key_and_succeeds():
    run = park_gate("order-2")

    assert open_gate("order-2", {"approved": True}) == 1
    assert refresh(run).status == "queued"
    run_until_idle(app_ids=["tests"])

    run = refresh(run)
    assert run.status == "succeeded"
    assert run.output == {"value": {"approved": True}}
    made = calls(run)
    assert len(made) == 2
    assert made[0].effect_key == made[1].effect_key == f"{run.pk}:0"
    assert made[0].generation < made[1].generation


def test_wake_committed_before_the_waiter_parks_still_wakes_it(start_worker, wait):
    # The action reads "not ready", then blocks until "go:" exists; the wake
    # commits in between, so it finds no parked run and only the rendezvous
    # signal can tell the parking run that it must not sleep.
    run = start_workflow_run("waits.gate", {"key": "early", "hold": "go:early"})
    worker = start_worker("--concurrency", "1")
    wait(lambda: calls(run), message="the action to read the gate")

    assert open_gate("early", "value") == 0
    DomainRow.objects.create(key="go:early")

    wait(lambda: refresh(run).status == "succeeded", message="the run to succeed", timeout=30)
    assert refresh(run).output == {"value": "value"}
    assert worker.proc.poll() is None


def test_wake_inside_a_rolled_back_transaction_wakes_nothing():
    run = park_gate("rolled-back")
    signals_before = WaitRendezvous.objects.get(
        app_id="tests", kind=GATE_KIND, key="rolled-back"
    ).signal_seq

    with pytest.raises(RuntimeError), transaction.atomic():
        DomainRow.objects.create(key="rolled-back", value=1)
        assert wake_workflow_runs_waiting_on(app_id="tests", kind=GATE_KIND, key="rolled-back") == 1
        raise RuntimeError("the caller's transaction fails")

    assert refresh(run).status == "waiting"
    rendezvous = WaitRendezvous.objects.get(app_id="tests", kind=GATE_KIND, key="rolled-back")
    assert rendezvous.signal_seq == signals_before
    assert run_until_idle(app_ids=["tests"])["runs"] == 0
    assert refresh(run).status == "waiting"


def test_deadline_reruns_the_step_with_the_same_effect_key_under_a_higher_generation():
    run = start_workflow_run("waits.poll", {"ready_after": 3, "every_s": 0.1})
    run_until_idle(app_ids=["tests"])
    parked = refresh(run)
    assert parked.status == "waiting" and parked.wait_deadline is not None

    run_until_idle(app_ids=["tests"], wait_for_deadlines=True)

    run = refresh(run)
    assert run.status == "succeeded"
    assert run.output == {"polls": 3}
    made = calls(run)
    assert {c.effect_key for c in made} == {f"{run.pk}:0"}
    generations = [c.generation for c in made]
    assert generations == sorted(set(generations)) and len(generations) == 3
    assert JournalEntry.objects.filter(run=run).count() == 1


def test_passing_deadlines_never_fail_the_step_or_count_as_failures():
    polls = max_consecutive_failures() + 2
    run = start_workflow_run("waits.poll", {"ready_after": polls, "every_s": 0.05})

    run_until_idle(app_ids=["tests"], wait_for_deadlines=True)

    run = refresh(run)
    assert run.status == "succeeded", (run.error_code, run.error_message)
    assert run.output == {"polls": polls}
    assert run.consecutive_failures == 0


def test_cancel_of_a_waiting_run_is_immediate():
    run = park_gate("to-cancel")

    returned = cancel_workflow_run(run.pk, "order withdrawn")

    assert returned.status == "canceled"
    assert refresh(run).status == "canceled"
    assert refresh(run).finished_at is not None


def test_late_wake_of_a_canceled_run_changes_nothing():
    run = park_gate("late")
    cancel_workflow_run(run.pk, "order withdrawn")
    before = refresh(run)

    assert open_gate("late", "too late") == 0
    assert run_until_idle(app_ids=["tests"])["runs"] == 0

    after = refresh(run)
    assert after.status == "canceled"
    assert (after.generation, after.updated_at) == (before.generation, before.updated_at)
    assert not JournalEntry.objects.filter(run=run).exists()


def test_parked_runs_hold_no_lease_and_no_worker_thread(start_worker, wait):
    # One thread: three runs can only all be parked if parking frees it.
    worker = start_worker("--concurrency", "1")
    gated = [start_workflow_run("waits.gate", {"key": f"thread-{i}"}) for i in range(3)]
    wait(lambda: all(refresh(r).status == "waiting" for r in gated), message="all runs parked")
    for run in gated:
        run = refresh(run)
        assert run.lease_expires_at is None

    other = start_workflow_run("test.pure", {"a": 1, "b": 2})
    wait(lambda: refresh(other).status == "succeeded", message="another run on the same thread")
    assert all(refresh(r).status == "waiting" for r in gated)

    for i in range(3):
        open_gate(f"thread-{i}", i)
    wait(lambda: all(refresh(r).status == "succeeded" for r in gated), message="woken runs")
    assert worker.proc.poll() is None
