"""Child runs: normal runs created once per parent step, awaited until all are terminal."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.test import override_settings

from k2b_workflows import (
    cancel_workflow_run,
    count_child_workflow_runs,
    start_workflow_run,
    wake_workflow_runs_waiting_on,
)
from k2b_workflows.models import BudgetAccount, JournalEntry, WorkflowRun
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall
from tests.support.kernel import execute_exactly
from tests.support.processes import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

APPS = ["fanout"]


def children_of(run) -> list[WorkflowRun]:
    return list(WorkflowRun.objects.filter(parent=run).order_by("parent_step", "child_index"))


def test_children_are_normal_runs_with_their_own_journal_and_status():
    parent = start_workflow_run("fanout.parent", {"items": [{"value": 1}, {"value": 2}]})

    run_until_idle(app_ids=APPS)

    kids = children_of(parent)
    assert [k.status for k in kids] == ["succeeded", "succeeded"]
    assert [k.root_id for k in kids] == [parent.id, parent.id]
    assert [k.generation for k in kids] == [1, 1]
    for kid in kids:
        assert list(JournalEntry.objects.filter(run=kid).values_list("action_name", flat=True)) == [
            "fanout.echo"
        ]


def test_parent_gets_one_result_per_input_in_input_order():
    items = [{"value": v} for v in range(6)]
    items[2] = {"fail": "CHILD_BROKE"}
    parent = start_workflow_run("fanout.parent", {"items": items})

    run_until_idle(app_ids=APPS)

    parent.refresh_from_db()
    assert parent.status == "succeeded"
    assert parent.output[2] == {"status": "failed", "output": None, "error_code": "CHILD_BROKE"}
    expected = [
        {"status": "succeeded", "output": {"echo": v}, "error_code": ""} for v in range(6) if v != 2
    ]
    assert [r for i, r in enumerate(parent.output) if i != 2] == expected


def test_parent_parks_until_every_child_is_terminal():
    parent = start_workflow_run("fanout.parent", {"items": [{"value": 1}, {"value": 2}]})
    assert execute_exactly(parent.id) == "waiting"
    first, second = children_of(parent)

    execute_exactly(first.id)
    parent.refresh_from_db()
    # One child ended: the parent is woken, finds the other still queued, parks again.
    assert parent.status == "queued"
    assert execute_exactly(parent.id) == "waiting"

    execute_exactly(second.id)
    assert execute_exactly(parent.id) == "succeeded"


def test_parent_waits_for_a_canceled_child_and_reports_it():
    parent = start_workflow_run("fanout.parent", {"items": [{"value": 1}, {"value": 2}]})
    execute_exactly(parent.id)
    _first, second = children_of(parent)

    cancel_workflow_run(second.id, "not needed")
    run_until_idle(app_ids=APPS)

    parent.refresh_from_db()
    assert parent.status == "succeeded"
    assert parent.output[1] == {"status": "canceled", "output": None, "error_code": "CANCELED"}
    assert parent.output[0]["status"] == "succeeded"


def test_replayed_parent_never_creates_its_children_twice():
    parent = start_workflow_run("fanout.parent", {"items": [{"value": 1}, {"value": 2}]})
    assert execute_exactly(parent.id) == "waiting"
    created = {k.id for k in children_of(parent)}

    # A spurious wake re-queues the parent between creation and completion of the step.
    wake_workflow_runs_waiting_on(app_id="fanout", kind="k2b.children", key=f"{parent.id}:0")
    assert execute_exactly(parent.id) == "waiting"

    assert {k.id for k in children_of(parent)} == created
    assert BudgetAccount.objects.get(root=parent).children == 2
    run_until_idle(app_ids=APPS)
    assert WorkflowRun.objects.filter(parent=parent).count() == 2


def test_create_child_workflow_runs_from_the_workflow_returns_runs_without_waiting():
    parent = start_workflow_run("fanout.create_from_run", {"items": [{"value": 7}, {"value": 8}]})

    assert execute_exactly(parent.id) == "succeeded"

    parent.refresh_from_db()
    kids = children_of(parent)
    assert [str(k.id) for k in kids] == parent.output["children"]
    assert [k.status for k in kids] == ["queued", "queued"]


def test_create_child_workflow_runs_from_an_action_context():
    parent = start_workflow_run("fanout.create_from_ctx", {"inputs": [{"value": 1}]})

    assert execute_exactly(parent.id) == "succeeded"

    kids = children_of(parent)
    assert len(kids) == 1
    assert kids[0].parent_step == 0
    assert kids[0].input == {"value": 1}


@pytest.mark.crash
def test_action_that_crashes_after_creating_children_creates_them_once(start_worker, wait):
    parent = start_workflow_run(
        "fanout.create_from_ctx",
        {"inputs": [{"value": 1}, {"value": 2}], "crash": "after_spawn"},
    )
    crashing = start_worker(
        "--concurrency", "1", "--app", "fanout", env={"K2B_TEST_CRASH": "after_spawn"}
    )
    wait(lambda: crashing.proc.poll() is not None, message="the worker to crash after spawning")
    assert WorkflowRun.objects.filter(parent=parent).count() == 2

    start_worker("--concurrency", "1", "--app", "fanout")
    wait(
        lambda: WorkflowRun.objects.get(pk=parent.id).status == "succeeded",
        timeout=30,
        message="the parent to succeed after the crash",
    )

    assert ProviderCall.objects.filter(action="fanout.spawn").count() == 2  # the step ran twice
    assert WorkflowRun.objects.filter(parent=parent).count() == 2  # children once
    assert BudgetAccount.objects.get(root=parent).children == 2


def test_count_child_workflow_runs_counts_per_status_in_one_query(django_assert_num_queries):
    parent = start_workflow_run("fanout.parent", {"items": [{"value": v} for v in range(3)]})
    execute_exactly(parent.id)
    first, second, _third = children_of(parent)
    execute_exactly(first.id)
    cancel_workflow_run(second.id, "not needed")

    with django_assert_num_queries(1):
        counts = count_child_workflow_runs(parent.id)

    assert counts["succeeded"] == 1
    assert counts["canceled"] == 1
    assert counts["queued"] == 1
    assert counts["running"] == counts["failed"] == counts["waiting"] == 0
    assert counts["total"] == 3


@override_settings(K2B_WORKFLOWS={"MAX_CHILDREN_PER_STEP": 3, "RETRY_BACKOFF_MS": 50})
def test_fan_out_past_the_bound_fails_the_step_before_creating_anything():
    parent = start_workflow_run("fanout.parent", {"items": [{"value": v} for v in range(4)]})

    run_until_idle(app_ids=APPS)

    parent.refresh_from_db()
    assert (parent.status, parent.error_code) == ("failed", "FAN_OUT_EXCEEDED")
    assert WorkflowRun.objects.filter(parent=parent).count() == 0


@override_settings(K2B_WORKFLOWS={"MAX_CHILDREN_PER_STEP": 1, "RETRY_BACKOFF_MS": 50})
def test_fan_out_past_the_bound_from_an_action_fails_the_step_with_its_code():
    parent = start_workflow_run("fanout.create_from_ctx", {"inputs": [{"value": 1}, {"value": 2}]})

    run_until_idle(app_ids=APPS)

    parent.refresh_from_db()
    assert (parent.status, parent.error_code) == ("failed", "FAN_OUT_EXCEEDED")
    assert WorkflowRun.objects.filter(parent=parent).count() == 0


def test_children_past_the_roots_max_steps_fail_before_anything_is_created():
    parent = start_workflow_run("fanout.parent_small", {"items": [{"value": v} for v in range(4)]})

    run_until_idle(app_ids=APPS)

    parent.refresh_from_db()
    assert (parent.status, parent.error_code) == ("failed", "MAX_STEPS_EXCEEDED")
    assert WorkflowRun.objects.filter(parent=parent).count() == 0
    assert BudgetAccount.objects.get(root=parent).children == 0


def test_children_calls_are_steps_of_the_loop_budget():
    parent = start_workflow_run("fanout.loop_children", {})

    run_until_idle(app_ids=APPS, timeout=20)

    parent.refresh_from_db()
    assert (parent.status, parent.error_code) == ("failed", "MAX_STEPS_EXCEEDED")
    assert JournalEntry.objects.filter(run=parent).count() == 3  # two calls, then the failure


def test_children_created_from_an_action_count_against_the_roots_max_steps():
    parent = start_workflow_run(
        "fanout.create_from_ctx", {"inputs": [{"value": v} for v in range(4)]}
    )

    run_until_idle(app_ids=APPS)

    parent.refresh_from_db()
    assert (parent.status, parent.error_code) == ("failed", "MAX_STEPS_EXCEEDED")
    assert WorkflowRun.objects.filter(parent=parent).count() == 0


def test_cancel_cancels_the_whole_subtree_at_once():
    parent = start_workflow_run("fanout.parent", {"items": [{"value": v} for v in range(3)]})
    execute_exactly(parent.id)
    kids = children_of(parent)
    execute_exactly(kids[0].id)

    cancel_workflow_run(parent.id, "operator stop")

    statuses = dict(WorkflowRun.objects.filter(root=parent).values_list("id", "status"))
    assert statuses[parent.id] == "canceled"
    assert statuses[kids[0].id] == "succeeded"  # already final: unchanged
    assert statuses[kids[1].id] == statuses[kids[2].id] == "canceled"
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM k2b_run WHERE status = 'queued'")
        assert cursor.fetchone()[0] == 0


def test_cancel_racing_a_finishing_child_is_retried_not_lost():
    """A child's finish locks child then parent; cancel locks parent then children.

    When the two deadlock, PostgreSQL aborts one of them: cancel must retry, not raise.
    """
    from django.db import connections, transaction

    from k2b_workflows.kernel import db
    from k2b_workflows.kernel.children import wake_parent

    parent = start_workflow_run("fanout.parent", {"items": [{"value": 1}]})
    execute_exactly(parent.id)
    (kid,) = children_of(parent)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE k2b_run SET status = 'running', generation = 1 WHERE id = %s", [kid.id]
        )
    kid.refresh_from_db()
    child_locked, outcome = threading.Event(), {}

    def finishing_child() -> None:
        try:
            with transaction.atomic():
                db.fence("default", kid.id, 1, 30_000)
                child_locked.set()
                wait_for(lambda: _lock_waiters() > 0, message="cancel to wait for the child row")
                wake_parent("default", kid)
            outcome["child"] = "committed"
        except Exception as exc:  # the deadlock victim
            outcome["child"] = repr(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=finishing_child)
    thread.start()
    child_locked.wait(10)
    canceled = cancel_workflow_run(parent.id, "racing a child")
    thread.join(20)

    assert canceled.status == "canceled"
    assert outcome["child"] == "committed"


def _lock_waiters() -> int:
    from django.db import connections

    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0]
