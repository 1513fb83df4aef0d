"""Fair shares (#50): runs of one queue and priority take turns by key, weighted.

The order is the claim's: most tests claim one run at a time and read whose
turn it was; one drains a backlog with a real worker process.
"""

from __future__ import annotations

import datetime as dt
import itertools

import pytest
from django.db import connection, transaction

from k2b_workflows import Fairness, InvalidInput, start_workflow_run, workflow
from k2b_workflows.control import start_workflow_runs
from k2b_workflows.kernel import claim, clock, flow
from k2b_workflows.models import WorkflowRun
from k2b_workflows.tasks import InvalidTaskCall, enqueue_many
from k2b_workflows.tasks.names import WORKFLOW_NAMES
from k2b_workflows.testing import run_until_idle
from tests.tasks_app import fair
from tests.tasks_app.tasks import EXTRA_ARGUMENTS

pytestmark = pytest.mark.django_db(transaction=True)

TASKS = [(WORKFLOW_NAMES[effect], 1) for effect in ("pure", "idempotent", "external")]


@workflow("fair.tenant_flow", fairness=Fairness(key="tenant", weights={"gold": 3}))
def tenant_flow(run, input):
    return input["tenant"]


@workflow("fair.plain")
def plain(run, input):
    return input


def claim_next(workflows=TASKS, limit: int = 1) -> list[WorkflowRun]:
    """Claim the next ``limit`` runs, in the claim's order."""
    with transaction.atomic():
        rows = claim.claim_runs(
            "default", worker_id="t", workflows=workflows, app_ids=None, limit=limit
        )
    runs = WorkflowRun.objects.in_bulk([r[0] for r in rows])
    return [runs[r[0]] for r in rows]


def tenants(runs: list[WorkflowRun]) -> list[str]:
    return [run.fairness_key for run in runs]


def claim_tenants(count: int, workflows=TASKS) -> list[str]:
    return [key for _ in range(count) for key in tenants(claim_next(workflows))]


# -- turns ------------------------------------------------------------------------------


def test_a_tenant_queued_behind_a_backlog_goes_next():
    """300 calls of one tenant, then 5 of another: the 5 are claimed among the first
    runs, not after the 300 (in line order they would be the last five)."""
    enqueue_many(fair.tenant_job, [((), {"tenant_id": "big", "n": n}) for n in range(300)])
    for n in range(5):
        fair.tenant_job.enqueue("small", n)
    order = claim_tenants(12)
    assert order.count("small") == 5, order
    # Turns: the backlog's tenant between each two of the other's.
    assert order[:11].count("small") == 5, order
    assert all(x != y for x, y in itertools.pairwise(order[1:11])), order


def test_keys_alternate_while_both_have_runs_queued():
    enqueue_many(fair.tenant_job, [((), {"tenant_id": "a", "n": n}) for n in range(50)])
    enqueue_many(fair.tenant_job, [((), {"tenant_id": "b", "n": n}) for n in range(50)])
    order = claim_tenants(20)
    # The second key's first run went in at the head of the line: from then on, turns.
    first_b = order.index("b")
    assert first_b <= 2, order
    turns = order[first_b:]
    assert all(x != y for x, y in itertools.pairwise(turns)), order


def test_a_heavier_key_takes_more_turns():
    """``gold`` weighs 3: three of its runs to one of a weight-1 key's."""
    enqueue_many(fair.tenant_job, [((), {"tenant_id": "gold", "n": n}) for n in range(60)])
    enqueue_many(fair.tenant_job, [((), {"tenant_id": "tin", "n": n}) for n in range(60)])
    order = claim_tenants(40)
    assert 28 <= order.count("gold") <= 32, order


def test_a_key_that_comes_back_goes_in_at_the_head_not_before_it():
    """A key whose runs were all claimed and that enqueues 100 more takes turns with
    the backlog from where the line stands: its new runs do not all go first."""
    enqueue_many(fair.tenant_job, [((), {"tenant_id": "a", "n": n}) for n in range(100)])
    claim_tenants(30)
    enqueue_many(fair.tenant_job, [((), {"tenant_id": "b", "n": n}) for n in range(100)])
    order = claim_tenants(20)
    assert 9 <= order.count("b") <= 11, order


def test_runs_without_a_key_keep_their_place_in_line():
    enqueue_many(fair.tenant_job, [((), {"tenant_id": "a", "n": n}) for n in range(5)])
    other = start_workflow_run("fair.plain", {})
    order = claim_next([*TASKS, ("fair.plain", 1)], limit=10)
    assert other.pk in {run.pk for run in order}
    assert WorkflowRun.objects.get(pk=other.pk).fair_line is None


def test_priority_goes_before_turns():
    enqueue_many(fair.tenant_job, [((), {"tenant_id": "a", "n": n}) for n in range(20)])
    urgent = fair.tenant_job.using(priority=10).enqueue("a", 99)
    fair.tenant_job.enqueue("b", 0)
    first = claim_next()[0]
    assert str(first.pk) == urgent.id


def test_a_delayed_run_stands_at_its_run_after_and_takes_turns_once_queued_again():
    later = fair.tenant_job.using(run_after=clock.now() + dt.timedelta(hours=1)).enqueue("a", 1)
    run = WorkflowRun.objects.get(pk=later.id)
    assert run.fair_line is None
    enqueue_many(fair.tenant_job, [((), {"tenant_id": "b", "n": n}) for n in range(3)])
    # Due now (as a retry or a wake would queue it): it gets its turn among the keys.
    WorkflowRun.objects.filter(pk=later.id).update(run_after=clock.now())
    run.refresh_from_db()
    assert run.fair_line is not None
    order = claim_tenants(3)  # in at the head: level with b's second run
    assert "a" in order, order


def test_the_claim_walks_one_index_in_line_order():
    """No sort and no second index: the claim reads the line's index (``k2b_run_queued``),
    whose expression is the line with the keys' turns in it."""
    enqueue_many(fair.tenant_job, [((), {"tenant_id": f"t{n % 50}", "n": n}) for n in range(500)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE k2b_run")
    statement, params = claim.claim_statement("t", TASKS, None, 4)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(claim.CLAIM_PLAN)
        cursor.execute("EXPLAIN " + statement, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "Index Scan using k2b_run_queued on k2b_run" in plan, plan
    # One sort: the claimed rows' own, of at most ``limit`` rows (``CLAIM_PLAN``).
    assert plan.count("Sort  (") == 1 and plan.index("Sort  (") < plan.index("CTE claimed"), plan
    assert flow.LINE in claim.claim_statement("t", TASKS, None, 4)[0]


def test_a_worker_drains_a_tenants_backlog_and_the_other_tenant_is_served_early():
    enqueue_many(fair.tenant_job, [((), {"tenant_id": "big", "n": n}) for n in range(300)])
    small = [fair.tenant_job.enqueue("small", n) for n in range(5)]
    run_until_idle()
    finished = list(
        WorkflowRun.objects.filter(task_path=fair.tenant_job.module_path)
        .order_by("finished_at")
        .values_list("fairness_key", flat=True)
    )
    assert len(finished) == 305
    assert set(finished[:20]) == {"big", "small"} and finished[:20].count("small") == 5
    assert all(r.refresh() or r.status == "SUCCESSFUL" for r in small)


def fair_index_reads() -> int:
    """Index entries read from the two fair-share indexes so far (this database)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT COALESCE(sum(idx_tup_read), 0) FROM pg_stat_user_indexes"
            " WHERE indexrelname IN ('k2b_run_fair_head', 'k2b_run_fair_key')"
        )
        return int(cursor.fetchone()[0])


def test_placing_each_run_reads_a_few_index_entries_however_long_the_backlog():
    """The trigger reads the head and the key's last run by a walk that stops at its
    first entry: a bulk enqueue into a table analyzed while it was empty reads a few
    entries a run, not every run queued before it (``triggers.IndexWalkTriggerSql``:
    planned on those statistics, each row read the whole queue)."""
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE k2b_run")  # the statistics of an empty table
    before = fair_index_reads()
    enqueue_many(fair.tenant_job, [((), {"tenant_id": f"t{n % 3}", "n": n}) for n in range(2000)])
    read = fair_index_reads() - before
    assert 0 < read < 10 * 2000, read


# -- workflows --------------------------------------------------------------------------


def test_a_workflows_runs_take_turns_by_the_input_field_or_the_key_given():
    for n in range(30):
        start_workflow_run("fair.tenant_flow", {"tenant": "a", "n": n})
    start_workflow_run("fair.tenant_flow", {"tenant": "a", "n": 99}, fairness_key="b")
    # In at the head: after the first run, level with the second (a tie either way).
    run = claim_next([("fair.tenant_flow", 1)], limit=3)
    assert "b" in tenants(run)
    assert WorkflowRun.objects.filter(fairness_key="b").get().fairness_weight == 1.0


def test_start_workflow_runs_of_a_workflow_with_fairness_takes_each_inputs_key():
    runs = start_workflow_runs(
        "fair.tenant_flow", [{"tenant": "gold"}, {"tenant": "tin"}, {"tenant": "tin"}]
    )
    rows = WorkflowRun.objects.in_bulk([r.pk for r in runs])
    assert sorted((r.fairness_key, r.fairness_weight) for r in rows.values()) == [
        ("gold", 3.0),
        ("tin", 1.0),
        ("tin", 1.0),
    ]


def test_a_fairness_key_on_a_workflow_without_a_declaration_takes_turns_at_weight_one():
    run = start_workflow_run("fair.plain", {}, fairness_key=7)
    run.refresh_from_db()
    assert (run.fairness_key, run.fairness_weight) == ("7", 1.0)
    assert run.fair_line is not None


# -- the key is sealed ------------------------------------------------------------------


def test_a_rewritten_key_breaks_the_start_seal():
    from k2b_workflows.kernel import seals

    result = fair.tenant_job.enqueue("a", 1)
    run = WorkflowRun.objects.get(pk=result.id)
    assert seals.start_problem(run) is None
    WorkflowRun.objects.filter(pk=run.pk).update(fairness_key="b")
    run.refresh_from_db()
    assert seals.start_problem(run) is not None


def test_enqueue_many_seals_each_calls_own_key():
    from k2b_workflows.kernel import seals

    enqueue_many(fair.tenant_job, [((), {"tenant_id": t}) for t in ("a", "gold", 3)])
    runs = list(WorkflowRun.objects.filter(task_path=fair.tenant_job.module_path))
    assert sorted((r.fairness_key, r.fairness_weight) for r in runs) == [
        ("3", 1.0),
        ("a", 1.0),
        ("gold", 3.0),
    ]
    assert all(seals.start_problem(r) is None for r in runs)


# -- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"key": "tenant id"}, "must name a parameter"),
        ({"key": 3}, "must name a parameter"),
        ({"key": "t", "weights": [1]}, "must be a dict"),
        ({"key": "t", "weights": {"a": 0}}, "from 0.01 to 100"),
        ({"key": "t", "weights": {"a": float("nan")}}, "must be a number"),
        ({"key": "t", "weights": {"a": True}}, "must be a number"),
        ({"key": "t", "weights": {1: 2}}, "is not a string"),
    ],
)
def test_a_fairness_that_cannot_mean_anything_is_refused_where_it_is_written(kwargs, message):
    with pytest.raises(InvalidInput, match=message):
        Fairness(**kwargs)


def test_a_fairness_key_that_is_not_a_parameter_is_refused_at_the_first_call():
    from k2b_workflows.tasks.options import check_fairness_key

    with pytest.raises(
        InvalidTaskCall, match="names \\['tenant'\\], not among the task's parameters"
    ):
        check_fairness_key(fair.tenant_job, Fairness(key="tenant"), "task t")
    check_fairness_key(fair.any_keywords, Fairness(key="tenant"), "task t")  # **kwargs: any


def test_a_call_whose_key_is_too_long_is_refused_and_inserts_nothing():
    with pytest.raises(InvalidTaskCall, match="longer than 200"):
        fair.tenant_job.enqueue("x" * 201)
    assert not WorkflowRun.objects.exists()


def test_a_workflow_start_without_its_key_field_is_refused():
    with pytest.raises(InvalidInput, match="Fairness\\(key='tenant'\\) names a field"):
        start_workflow_run("fair.tenant_flow", {"n": 1})
    with pytest.raises(InvalidInput, match="fairness must be a Fairness"):
        workflow("fair.bad", fairness="tenant")
    assert not WorkflowRun.objects.exists()


@pytest.mark.skipif(not EXTRA_ARGUMENTS, reason="@task takes no fairness= on Django 6.0")
def test_a_fairness_declared_on_the_task_wins_over_settings():
    result = fair.declared_on_task.enqueue("big")
    run = WorkflowRun.objects.get(pk=result.id)
    assert (run.fairness_key, run.fairness_weight) == ("big", 2.0)
