"""Progress of a running task call or workflow step (#49): ``set_progress``, ``progress_of``.

Written on a connection of its own, never in the step's transaction: seen by
another process while the call runs, kept when the step fails or rolls back,
at most a few writes a second however often it is called, the last value
always, kept after the run ends, shown by the admin and by ``workflowrun``.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.management import call_command
from django.urls import reverse

from k2b_workflows import (
    Action,
    Effect,
    InvalidInput,
    Progress,
    Retry,
    progress_of,
    set_progress,
    start_workflow_run,
    succeeded,
    workflow,
)
from k2b_workflows.kernel import progress as writer
from k2b_workflows.models import RunProgress, WorkflowRun
from k2b_workflows.models.progress import MAX_NOTE
from k2b_workflows.testing import run_until_idle
from tests.models import DomainRow
from tests.tasks_app import held, reporting
from tests.tasks_app import tasks as t

try:
    from django.tasks import TaskContext
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskContext  # type: ignore[no-redef]

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 90  # generous: the machine is shared; the waits end on their condition

#: Contexts actions kept past their step, by key.
KEPT: dict[str, Any] = {}


class ReportsThenRollsBack(Action):
    """TRANSACTIONAL: reports, writes a row in the step's transaction, then raises."""

    name = "progress.reports_then_rolls_back"
    effect = Effect.TRANSACTIONAL
    retry = Retry(max_attempts=1)

    def run(self, ctx: Any, input: Any) -> Any:
        set_progress(ctx, 5, 10, note="inside the step's transaction")
        DomainRow.objects.using(ctx.tx.using).create(key=input["key"])
        raise RuntimeError("the step rolls back")


class KeepsItsContext(Action):
    name = "progress.keeps_its_context"
    effect = Effect.PURE

    def run(self, ctx: Any, input: Any) -> Any:
        KEPT[input["key"]] = ctx
        set_progress(ctx, 1, 1)
        return succeeded({})


class ReportsFromAThread(Action):
    """PURE: two steps; the first reports from a thread it starts, the second not at all."""

    name = "progress.reports_from_a_thread"
    effect = Effect.PURE

    def run(self, ctx: Any, input: Any) -> Any:
        import threading

        thread = threading.Thread(target=set_progress, args=(ctx, 7, None, "from a thread"))
        thread.start()
        thread.join()
        return succeeded({})


@workflow("progress.rolls_back", app_id="progress")
def rolls_back(run: Any, input: Any) -> Any:
    return run.step(ReportsThenRollsBack, input)


@workflow("progress.kept", app_id="progress")
def kept(run: Any, input: Any) -> Any:
    return run.step(KeepsItsContext, input)


@workflow("progress.threaded", app_id="progress")
def threaded(run: Any, input: Any) -> Any:
    return run.step(ReportsFromAThread, input)


@pytest.fixture(autouse=True)
def _writer_stopped():
    """Each test starts and ends with nothing pending and no writer connection open."""
    writer.writer.stop()
    yield
    writer.writer.stop()
    KEPT.clear()


def shown(result_or_id: Any) -> tuple | None:
    progress = progress_of(result_or_id)
    return None if progress is None else (progress.done, progress.total, progress.note)


# -- seen while it runs, from another process ---------------------------------------


@pytest.mark.crash
def test_progress_is_seen_by_another_process_while_the_task_still_runs(start_worker, wait):
    key = f"p-{uuid.uuid4()}"
    result = reporting.reports.enqueue(key, 40)
    worker = start_worker("--concurrency", "1")
    wait(
        lambda: shown(result) == (1, 40, "first item"),
        timeout=TIMEOUT,
        message=lambda: f"progress 1/40 while held:\n{worker.report()}",
    )
    # Read while the call is certainly inside its function: it waits for the release.
    assert WorkflowRun.objects.get(pk=result.id).status == "running"
    assert progress_of(result.id) == progress_of(uuid.UUID(result.id))
    held.release(key)
    wait(
        lambda: WorkflowRun.objects.get(pk=result.id).status == "succeeded",
        timeout=TIMEOUT,
        message=lambda: f"task to succeed:\n{worker.report()}",
    )
    # The last value was written before the run's end committed.
    assert shown(result) == (40, 40, "all done")
    run = WorkflowRun.objects.get(pk=result.id)
    assert shown(run) == (40, 40, "all done")


# -- a failed or rolled-back step keeps its progress ---------------------------------


def test_a_task_that_fails_after_reporting_keeps_its_progress():
    result = reporting.reports_then_fails.enqueue(3, 10)
    run_until_idle()
    assert WorkflowRun.objects.get(pk=result.id).status == "failed"
    assert shown(result) == (3, 10, "then it failed")


def test_a_transactional_step_that_rolls_back_keeps_its_progress():
    """Its row is rolled back with the step; its progress, written on another
    connection, is not."""
    run = start_workflow_run("progress.rolls_back", {"key": "rolled-back"})
    run_until_idle()
    assert WorkflowRun.objects.get(pk=run.pk).status == "failed"
    assert not DomainRow.objects.filter(key="rolled-back").exists()
    assert shown(run) == (5, 10, "inside the step's transaction")


# -- bounded writes, the last value kept ---------------------------------------------


@pytest.mark.parametrize("pause", [0.0, 0.0005], ids=["tight", "over-a-second"])
def test_two_thousand_calls_in_a_loop_write_a_few_times_and_keep_the_last_value(pause):
    """As fast as it can (a few milliseconds), and spread over a second or more, where
    a writer without its throttle writes hundreds of times."""
    before = writer.writer.writes
    started = time.monotonic()
    result = reporting.tight_loop.enqueue(2000, pause)
    run_until_idle()
    elapsed = time.monotonic() - started
    writes = writer.writer.writes - before
    assert WorkflowRun.objects.get(pk=result.id).status == "succeeded"
    # The first value at once, then at most one per interval, then the last one.
    assert 1 <= writes <= 2 + elapsed / writer.MIN_INTERVAL_S, (writes, elapsed)
    # Read as soon as the run has ended: the step's end wrote its last value.
    assert shown(result) == (2000, 2000, "item 2000")


def test_the_last_value_is_written_at_the_steps_end_not_when_the_interval_passes(monkeypatch):
    """With an interval longer than the test, only the step's end can have written the
    last value by the time the run has ended. The items are a few milliseconds apart:
    the first write (at once) is long done when the last value is set."""
    monkeypatch.setattr(writer, "MIN_INTERVAL_S", 600.0)
    result = reporting.tight_loop.enqueue(100, 0.005)
    run_until_idle()
    assert WorkflowRun.objects.get(pk=result.id).status == "succeeded"
    assert shown(result) == (100, 100, "item 100")


def test_an_async_task_reports_its_progress():
    result = reporting.areports.enqueue(50)
    run_until_idle()
    assert t.add.get_result  # the tasks module is loaded (and the backend with it)
    assert WorkflowRun.objects.get(pk=result.id).status == "succeeded"
    assert shown(result) == (50, 50, "async")


def test_a_thread_the_step_started_may_report():
    run = start_workflow_run("progress.threaded", {})
    run_until_idle()
    progress = progress_of(run)
    assert progress is not None and (progress.done, progress.total) == (7, None)
    assert progress.fraction is None and progress.note == "from a thread"


def test_a_dry_run_checks_the_values_and_writes_nothing():
    from k2b_workflows import dry_run

    report = dry_run("progress.threaded", {})
    assert not report.failed, report
    assert not RunProgress.objects.exists()


def test_progress_is_kept_after_the_run_and_purged_with_it():
    import datetime as dt

    from k2b_workflows.kernel import clock
    from k2b_workflows.retention import purge_finished_runs

    result = reporting.reports_then_fails.enqueue(2, 4)
    run_until_idle()
    progress = progress_of(result)
    assert isinstance(progress, Progress) and progress.fraction == 0.5
    assert progress.updated_at <= clock.now()
    WorkflowRun.objects.filter(pk=result.id).update(finished_at=clock.now() - dt.timedelta(days=3))
    counts = purge_finished_runs(older_than=dt.timedelta(days=1))
    assert counts["progress"] == 1
    assert not RunProgress.objects.filter(run_id=result.id).exists()


def test_a_run_that_never_reported_has_no_progress():
    result = t.add.enqueue(1, 2)
    run_until_idle()
    assert progress_of(result) is None
    assert progress_of(str(uuid.uuid4())) is None


def test_a_stale_generation_never_overwrites_a_newer_ones_progress():
    from k2b_workflows.kernel import clock

    run_id = uuid.uuid4()
    ctx = SimpleNamespace(run_id=run_id, using="default", generation=2)
    writer.record(ctx, 2, 2, "new owner", clock.now())
    assert writer.writer.flush()
    writer.record(SimpleNamespace(**{**vars(ctx), "generation": 1}), 1, 2, "stale", clock.now())
    assert writer.writer.flush()
    assert shown(run_id) == (2, 2, "new owner")


# -- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("done", "total", "note", "message"),
    [
        (-1, None, "", "done must not be negative"),
        (1, -2, "", "total must not be negative"),
        (5, 4, "", r"total \(4\) must not be less than done \(5\)"),
        ("3", None, "", "done must be an int, not str"),
        (2.5, None, "", "done must be an int, not float"),
        (True, None, "", "done must be an int, not bool"),
        (1, 2.0, "", "total must be an int, not float"),
        (1, None, "x" * (MAX_NOTE + 1), f"note is {MAX_NOTE + 1} characters long"),
        (1, None, 7, "note must be a str, not int"),
        (1, None, "a\x00b", "note must not contain NUL"),
        (2**63, None, "", "done must be at most"),
    ],
)
def test_bad_values_are_refused_naming_what_is_wrong(done, total, note, message):
    with pytest.raises(InvalidInput, match=message):
        set_progress(object(), done, total, note=note)


def test_something_that_is_not_a_context_is_refused():
    with pytest.raises(InvalidInput, match=r"takes a running action's ctx .* not object"):
        set_progress(object(), 1)


def test_the_context_of_a_task_call_not_running_is_refused():
    result = t.context_info.enqueue()
    run_until_idle()
    context = TaskContext(task_result=t.context_info.get_result(result.id))
    with pytest.raises(InvalidInput, match=f"task call {result.id} is not running"):
        set_progress(context, 1)


def test_a_ctx_kept_past_its_step_is_refused():
    run = start_workflow_run("progress.kept", {"key": "kept"})
    run_until_idle()
    with pytest.raises(InvalidInput, match=f"step 0 of run {run.pk} is not running"):
        set_progress(KEPT["kept"], 2, 2)
    assert shown(run) == (1, 1, "")


def test_a_bad_value_inside_a_task_fails_the_call_with_what_is_wrong():
    result = reporting.misreports.enqueue(7, 3, "")
    run_until_idle()
    failed = reporting.misreports.get_result(result.id)
    assert failed.errors
    assert "total (3) must not be less than done (7)" in failed.errors[0].traceback
    assert progress_of(result) is None


def test_progress_of_refuses_what_names_no_run():
    with pytest.raises(InvalidInput, match="'nope' is not a run id"):
        progress_of("nope")
    with pytest.raises(InvalidInput, match="takes a TaskResult, a WorkflowRun or a run id"):
        progress_of(42)


# -- where operators see it ----------------------------------------------------------


def test_the_admin_run_page_shows_a_bar_with_done_total_the_note_and_when(admin_client):
    result = reporting.reports_then_fails.enqueue(3, 10)
    run_until_idle()
    response = admin_client.get(reverse("admin:k2b_workflows_workflowrun_change", args=[result.id]))
    assert response.status_code == 200
    html = response.content.decode()
    assert '<progress class="k2b-progress" value="3" max="10">' in html
    assert "3 / 10 (30%)" in html and "then it failed" in html and "updated " in html


def test_the_admin_run_page_of_a_run_without_progress_shows_none(admin_client):
    result = t.add.enqueue(1, 2)
    run_until_idle()
    response = admin_client.get(reverse("admin:k2b_workflows_workflowrun_change", args=[result.id]))
    assert response.status_code == 200
    assert "k2b-progress" not in response.content.decode().replace("k2b-progress {", "")


def test_workflowrun_show_prints_the_progress():
    result = reporting.reports_then_fails.enqueue(3, 10)
    run_until_idle()
    out = io.StringIO()
    call_command("workflowrun", "show", result.id, stdout=out)
    assert "progress  3 / 10 (30%) · then it failed (at " in out.getvalue()
    out = io.StringIO()
    call_command("workflowrun", "show", result.id, "--json", stdout=out)
    progress = json.loads(out.getvalue())["run"]["progress"]
    assert (progress["done"], progress["total"], progress["note"]) == (3, 10, "then it failed")
