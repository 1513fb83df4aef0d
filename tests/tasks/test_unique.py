"""Unique, replace, debounce (#49): one run per key of a task's or workflow's calls.

In-process on real PostgreSQL; the races use two real connections (one per
thread) in concurrent transactions.
"""

from __future__ import annotations

import datetime as dt
import threading
import uuid

import pytest
from django.db import connections, transaction

from k2b_workflows import (
    InvalidInput,
    Unique,
    codes,
    retry_workflow_run,
    start_workflow_run,
    workflow,
)
from k2b_workflows.control import start_workflow_runs
from k2b_workflows.kernel import clock, seals
from k2b_workflows.models import WorkflowRun
from k2b_workflows.tasks import InvalidTaskCall, enqueue_many
from k2b_workflows.tasks.compat import signals_api
from k2b_workflows.testing import run_until_idle
from tests.support.admin import run_url, user_with
from tests.tasks_app import unique as u
from tests.tasks_app.tasks import EXTRA_ARGUMENTS, task

try:
    from django.tasks import TaskResultStatus
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskResultStatus  # type: ignore[no-redef]

pytestmark = pytest.mark.django_db(transaction=True)
pytest_plugins = ["k2b_workflows.pytest_plugin"]


def runs_of(task) -> list[WorkflowRun]:
    path = f"{task.func.__module__}.{task.func.__qualname__}"
    return list(WorkflowRun.objects.filter(task_path=path).order_by("created_at"))


@pytest.fixture
def enqueued_signals():
    sent = []

    def receiver(sender, task_result, **kwargs):
        sent.append(task_result.id)

    signals_api.task_enqueued.connect(receiver)
    yield sent
    signals_api.task_enqueued.disconnect(receiver)


# -- one key, one run -------------------------------------------------------------------


def test_a_call_whose_key_a_run_holds_returns_that_run_and_inserts_nothing(enqueued_signals):
    first = u.rebuild_index.enqueue(7)
    second = u.rebuild_index.enqueue(site_id=7, verbose=True)
    assert second.id == first.id
    assert second.status == TaskResultStatus.READY
    assert second.args == [7]  # the holder's call, not this one
    assert len(runs_of(u.rebuild_index)) == 1
    assert enqueued_signals == [first.id]  # task_enqueued once, for the run inserted


def test_another_key_is_another_run():
    assert u.rebuild_index.enqueue(7).id != u.rebuild_index.enqueue(8).id
    assert len(runs_of(u.rebuild_index)) == 2


def test_without_keys_every_argument_bound_with_its_defaults_is_the_key():
    first = u.every_argument.enqueue(1)
    assert u.every_argument.enqueue(a=1).id == first.id
    assert u.every_argument.enqueue(1, b=2).id == first.id
    assert u.every_argument.enqueue(1, b=3).id != first.id
    assert u.every_argument.enqueue(1, c=3).id != first.id


def test_a_task_taking_a_context_binds_its_key_without_it():
    assert u.with_context.enqueue(5).id == u.with_context.enqueue(site_id=5).id


def test_the_key_is_the_tasks_own():
    assert u.rebuild_index.enqueue(7).id != u.recent.enqueue(7).id


def test_options_tasks_in_settings_declare_it_too():
    first = u.by_settings.enqueue(3, note="a")
    assert u.by_settings.enqueue(site_id=3, note="b").id == first.id
    assert runs_of(u.by_settings)[0].input["kwargs"] == {"site_id": 3, "note": "b"}


# -- states and period ------------------------------------------------------------------


def test_a_finished_run_lets_its_key_go_unless_its_states_keep_it():
    first = u.rebuild_index.enqueue(7)
    kept = u.kept.enqueue(7)
    run_until_idle()
    again = u.rebuild_index.enqueue(7)
    assert again.id != first.id
    still = u.kept.enqueue(7)
    assert still.id == kept.id
    assert still.status == TaskResultStatus.SUCCESSFUL
    assert still.return_value == 7


def test_a_run_enqueued_a_period_ago_or_more_lets_its_key_go(k2b_clock):
    first = u.recent.enqueue(7)
    k2b_clock.advance(minutes=9, seconds=59)
    assert u.recent.enqueue(7).id == first.id
    k2b_clock.advance(seconds=1)
    second = u.recent.enqueue(7)
    assert second.id != first.id
    assert u.recent.enqueue(7).id == second.id
    # The first run still runs: only its key was let go.
    assert WorkflowRun.objects.get(pk=first.id).status == "queued"


def test_a_retried_failed_run_that_let_its_key_go_does_not_take_it_back():
    first = u.rebuild_index.enqueue(7)
    WorkflowRun.objects.filter(pk=first.id).update(status="running", generation=1)
    run = WorkflowRun.objects.get(pk=first.id)
    _fail(run)
    second = u.rebuild_index.enqueue(7)
    assert second.id != first.id
    retry_workflow_run(first.id, actor=user_with("retry_workflowrun"), reason="try again")
    assert WorkflowRun.objects.get(pk=first.id).unique_key is None
    assert u.rebuild_index.enqueue(7).id == second.id


def _fail(run: WorkflowRun) -> None:
    """End ``run`` FAILED as the kernel does (sealed)."""
    WorkflowRun.objects.filter(pk=run.pk).update(
        status="failed",
        error_code=codes.WORKFLOW_RETRY_EXHAUSTED,
        end_seal=seals.end_seal(run.pk, "failed", codes.WORKFLOW_RETRY_EXHAUSTED, run.generation),
        finished_at=clock.now(),
    )


# -- replace and debounce ---------------------------------------------------------------


def test_replace_gives_a_ready_run_the_calls_arguments_priority_and_run_after():
    first = u.replaced.enqueue(7, note="old")
    later = clock.now() + dt.timedelta(minutes=5)
    second = u.replaced.using(priority=9, run_after=later).enqueue(site_id=7, note="new")
    assert second.id == first.id
    run = WorkflowRun.objects.get(pk=first.id)
    assert run.input["args"] == [] and run.input["kwargs"] == {"site_id": 7, "note": "new"}
    assert run.input["priority"] == 9
    assert run.priority == 9 + 100
    assert run.run_after == later
    assert seals.start_problem(run) is None  # re-sealed by the kernel
    assert second.kwargs == {"site_id": 7, "note": "new"}


def test_a_replaced_run_runs_with_the_last_calls_arguments():
    u.replaced.enqueue(7, note="old")
    result = u.replaced.enqueue(7, note="new")
    run_until_idle()
    assert u.replaced.get_result(result.id).return_value == "new"


def test_debounce_moves_a_ready_runs_start_never_past_its_max_wait(k2b_clock):
    first = u.debounced.enqueue(7, note="a")
    run = WorkflowRun.objects.get(pk=first.id)
    assert run.run_after == run.created_at + dt.timedelta(seconds=30)
    k2b_clock.advance(seconds=20)
    before = clock.now()
    u.debounced.enqueue(7, note="b")
    after = clock.now()
    run = WorkflowRun.objects.get(pk=first.id)
    wait = dt.timedelta(seconds=30)
    assert before + wait <= run.run_after <= after + wait
    assert run.input["args"] == [7] and run.input["kwargs"] == {"note": "b"}
    k2b_clock.advance(seconds=80)  # 100 s after the first call; max_wait is 120 s
    u.debounced.enqueue(7, note="c")
    run = WorkflowRun.objects.get(pk=first.id)
    assert run.run_after == run.created_at + dt.timedelta(minutes=2)
    assert seals.start_problem(run) is None
    assert len(runs_of(u.debounced)) == 1


def test_a_running_run_is_never_changed():
    first = u.replaced.enqueue(7, note="old")
    WorkflowRun.objects.filter(pk=first.id).update(status="running", generation=1)
    before = WorkflowRun.objects.get(pk=first.id)
    again = u.replaced.enqueue(7, note="new")
    assert again.id == first.id
    after = WorkflowRun.objects.get(pk=first.id)
    assert (after.input, after.run_after, after.start_seal) == (
        before.input,
        before.run_after,
        before.start_seal,
    )


def test_a_holder_whose_seal_is_broken_is_not_resealed():
    first = u.replaced.enqueue(7, note="old")
    WorkflowRun.objects.filter(pk=first.id).update(principal={"user": "mallory"})
    with pytest.raises(InvalidInput, match="does not match its seal"):
        u.replaced.enqueue(7, note="new")
    assert seals.start_problem(WorkflowRun.objects.get(pk=first.id)) is not None


def test_the_run_page_shows_the_key_and_where_it_is_held(admin_client):
    result = u.kept.enqueue(7)
    page = admin_client.get(run_url(WorkflowRun.objects.get(pk=result.id))).content.decode()
    key = WorkflowRun.objects.get(pk=result.id).unique_key
    assert f"{key[:16]}… (held while ready, running, successful)" in page


# -- races ------------------------------------------------------------------------------


def _race(first_commits: bool) -> tuple[str, str]:
    """Two calls of one key in concurrent transactions on two connections: the first
    inserts and holds its transaction open while the second inserts; then the first
    commits or rolls back. Returns the two results' ids."""
    inserted, release = threading.Event(), threading.Event()
    ids: dict[str, str] = {}
    errors: list[BaseException] = []

    class Rollback(Exception):
        pass

    def first() -> None:
        try:
            with transaction.atomic():
                ids["first"] = u.rebuild_index.enqueue(7).id
                inserted.set()
                release.wait(30)
                if not first_commits:
                    raise Rollback
        except Rollback:
            pass
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            inserted.set()
        finally:
            connections.close_all()

    def second() -> None:
        try:
            with transaction.atomic():
                ids["second"] = u.rebuild_index.enqueue(site_id=7).id
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    one = threading.Thread(target=first)
    one.start()
    assert inserted.wait(30)
    two = threading.Thread(target=second)
    two.start()
    _wait_for_a_blocked_insert_or_the_end_of(two)
    release.set()
    one.join(30)
    two.join(30)
    assert not errors, errors
    return ids["first"], ids["second"]


def _wait_for_a_blocked_insert_or_the_end_of(second: threading.Thread) -> None:
    """Until the second call's insert waits on the first's transaction (a lock wait),
    or the second call ended without waiting (a look-first design does not wait)."""
    sql = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND query LIKE '%%INSERT INTO%%k2b_run%%'"
    )
    pause = threading.Event()
    for _ in range(600):
        with connections["default"].cursor() as cursor:
            cursor.execute(sql)
            if cursor.fetchone()[0]:
                return
        if not second.is_alive():
            return
        pause.wait(0.05)
    raise AssertionError("the second call neither waited for the first nor ended")


def test_two_calls_in_concurrent_transactions_give_one_run():
    first, second = _race(first_commits=True)
    assert first == second
    assert [str(r.pk) for r in runs_of(u.rebuild_index)] == [first]


def test_when_the_first_rolls_back_the_second_inserts_its_own():
    first, second = _race(first_commits=False)
    assert second != first
    assert [str(r.pk) for r in runs_of(u.rebuild_index)] == [second]


# -- enqueue_many -----------------------------------------------------------------------


def test_enqueue_many_applies_it_within_the_batch_and_against_existing_runs(enqueued_signals):
    existing = u.rebuild_index.enqueue(9)
    results = enqueue_many(u.rebuild_index, [([7], {}), ([], {"site_id": 7}), ([9], {})])
    assert results[0].id == results[1].id
    assert results[2].id == existing.id
    assert len(runs_of(u.rebuild_index)) == 2
    assert enqueued_signals == [existing.id, results[0].id]


def test_enqueue_many_replaces_within_the_batch():
    results = enqueue_many(u.replaced, [([7], {"note": "a"}), ([7], {"note": "b"})])
    assert results[0].id == results[1].id
    assert runs_of(u.replaced)[0].input["kwargs"] == {"note": "b"}


# -- workflows --------------------------------------------------------------------------


@workflow("tests.unique.per_site", unique=Unique(keys=("site_id",)))
def per_site(run, input):
    return input


@workflow("tests.unique.plain")
def plain(run, input):
    return input


def test_a_workflow_declaring_unique_starts_one_run_per_key():
    first = start_workflow_run("tests.unique.per_site", {"site_id": 7, "n": 1})
    assert start_workflow_run("tests.unique.per_site", {"site_id": 7, "n": 2}).pk == first.pk
    assert start_workflow_run("tests.unique.per_site", {"site_id": 8}).pk != first.pk


def test_start_workflow_run_takes_unique_and_an_idempotency_key_keeps_its_meaning():
    once = Unique(replace=True)
    first = start_workflow_run("tests.unique.plain", {"a": 1}, unique=once)
    assert start_workflow_run("tests.unique.plain", {"a": 1}, unique=once).pk == first.pk
    keyed = start_workflow_run("tests.unique.plain", {"a": 2}, idempotency_key="k", unique=once)
    again = start_workflow_run("tests.unique.plain", {"a": 2}, idempotency_key="k", unique=once)
    assert again.pk == keyed.pk
    assert WorkflowRun.objects.filter(workflow_name="tests.unique.plain").count() == 2


def test_a_bulk_start_of_a_workflow_declaring_unique_meets_each_key_once():
    runs = start_workflow_runs(
        "tests.unique.per_site", [{"site_id": 1}, {"site_id": 1, "n": 2}, {"site_id": 2}]
    )
    assert runs[0].pk == runs[1].pk != runs[2].pk
    assert WorkflowRun.objects.filter(workflow_name="tests.unique.per_site").count() == 2


def test_a_workflows_key_names_fields_of_its_input():
    with pytest.raises(InvalidInput, match="site_id"):
        start_workflow_run("tests.unique.per_site", {"n": 1})
    assert not WorkflowRun.objects.filter(workflow_name="tests.unique.per_site").exists()


# -- bad declarations -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"keys": "site_id"}, r"write keys=\('site_id',\)"),
        ({"keys": ()}, "names no parameter"),
        ({"keys": ("a", "a")}, "twice"),
        ({"period": dt.timedelta(seconds=-1)}, "period=...\\) must be a positive"),
        ({"period": 10}, "must be a timedelta"),
        ({"states": ("running",)}, "'ready' and the states after it"),
        ({"states": ("ready", "successful")}, "without a gap"),
        ({"states": ("ready", "done")}, "names \\['done'\\]"),
        ({"max_wait": dt.timedelta(minutes=1)}, "bounds a debounce"),
        (
            {"debounce": dt.timedelta(minutes=2), "max_wait": dt.timedelta(minutes=1)},
            "shorter than its debounce",
        ),
        ({"replace": "yes"}, "True or False"),
    ],
)
def test_a_declaration_that_cannot_mean_anything_is_refused(kwargs, error):
    with pytest.raises(InvalidInput, match=error):
        Unique(**kwargs)


@pytest.mark.skipif(not EXTRA_ARGUMENTS, reason="@task takes no unique= on Django 6.0")
def test_a_key_that_is_not_a_parameter_of_the_task_is_refused_at_its_declaration():
    with pytest.raises(
        InvalidTaskCall, match=r"names \['site'\], not among the task's parameters \(site_id\)"
    ):
        task(unique=Unique(keys=("site",)))(u.undeclared)
    with pytest.raises(InvalidTaskCall, match="unique must be a Unique"):
        task(unique={"keys": ["site_id"]})(u.undeclared)


def test_unique_on_a_workflow_must_be_a_unique():
    with pytest.raises(InvalidInput, match="unique must be a Unique"):
        workflow(f"tests.unique.{uuid.uuid4().hex}", unique=("site_id",))
