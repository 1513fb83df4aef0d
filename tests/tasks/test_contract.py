"""django.tasks on the kernel (#37): the contract of ``k2b_workflows.tasks``, line by line.

In-process (``run_until_idle``) on real PostgreSQL; crashes with real worker
processes are in ``test_workers.py``.
"""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from django.db import transaction
from django.utils import timezone

from k2b_workflows import Schedule, pause_queue, resume_queue
from k2b_workflows.kernel import schedule_passes, seals, starts
from k2b_workflows.models import TaskAttempt, WorkflowRun
from k2b_workflows.tasks import (
    InvalidTaskCall,
    WorkflowsBackend,
    effect_key,
    enqueue_many,
    schedule_task,
)
from k2b_workflows.tasks.compat import TaskResultDoesNotExist, signals_api
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall
from tests.tasks_app import tasks as t
from tests.tasks_app.tasks import EXTRA_ARGUMENTS

try:
    from django.tasks import TaskResultStatus, task, task_backends
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskResultStatus, task, task_backends  # type: ignore[no-redef]

pytestmark = pytest.mark.django_db(transaction=True)
pytest_plugins = ["k2b_workflows.pytest_plugin"]

READY, RUNNING = TaskResultStatus.READY, TaskResultStatus.RUNNING
SUCCESSFUL, FAILED = TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED


def run(result_id: str) -> WorkflowRun:
    return WorkflowRun.objects.get(pk=result_id)


def test_the_backend_declares_all_four_capabilities():
    backend = task_backends["default"]
    assert isinstance(backend, WorkflowsBackend)
    assert backend.supports_defer and backend.supports_async_task
    assert backend.supports_get_result and backend.supports_priority


def test_a_task_call_is_a_run_and_its_result_reads_back_from_any_process():
    result = t.add.enqueue(2, 3)
    assert result.status == READY
    assert result.id == str(run(result.id).pk)
    assert run(result.id).workflow_name == "k2b.task.pure"
    run_until_idle()
    again = t.add.get_result(result.id)
    assert again.status == SUCCESSFUL
    assert again.return_value == 5
    assert again.args == [2, 3] and again.kwargs == {}
    assert again.enqueued_at <= again.started_at <= again.finished_at
    assert again.last_attempted_at == again.started_at
    assert len(again.worker_ids) == 1 and again.attempts == 1
    assert again.errors == []
    result.refresh()
    assert result.status == SUCCESSFUL and result.return_value == 5


def test_an_enqueue_rolled_back_never_runs():
    with pytest.raises(RuntimeError), transaction.atomic():
        result = t.add.enqueue(1, 1)
        raise RuntimeError("the view failed")
    assert not WorkflowRun.objects.filter(pk=result.id).exists()
    assert run_until_idle()["succeeded"] == 0
    with pytest.raises(TaskResultDoesNotExist):
        t.add.get_result(result.id)


def test_enqueue_inserts_on_the_callers_connection_in_its_transaction():
    with transaction.atomic():
        result = t.add.enqueue(1, 2)
        # Visible to the caller's own connection before its commit: the same transaction.
        assert WorkflowRun.objects.filter(pk=result.id).exists()
    assert run(result.id).status == "queued"


def test_unknown_and_malformed_ids_raise_task_result_does_not_exist():
    for bad in ("not-a-uuid", "", str(uuid.uuid4()), None):
        with pytest.raises(TaskResultDoesNotExist):
            task_backends["default"].get_result(bad)


def test_a_workflow_run_is_not_a_task_result():
    from k2b_workflows import start_workflow_run

    other = start_workflow_run("test.pure", {"a": 1, "b": 2})
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result(str(other.pk))


def test_an_exception_fails_the_task_with_its_error_and_no_incident():
    result = t.boom.enqueue("password=hunter2 went wrong")
    run_until_idle()
    result.refresh()
    assert result.status == FAILED
    assert len(result.errors) == 1
    error = result.errors[0]
    assert error.exception_class_path == "builtins.ValueError"
    assert error.exception_class is ValueError
    assert "went wrong" in error.traceback and "Traceback" in error.traceback
    assert "hunter2" not in error.traceback  # scrubbed as every stored error is
    assert run(result.id).error_code == "TASK_FAILED"
    assert ProviderCall.objects.filter(action="task.boom").count() == 1  # never retried


def test_an_external_task_that_raises_fails_without_an_incident():
    result = t.external_boom.enqueue("declined")
    run_until_idle()
    result.refresh()
    assert result.status == FAILED
    assert run(result.id).status == "failed"
    assert result.errors[0].exception_class_path == "builtins.RuntimeError"
    assert ProviderCall.objects.filter(action="task.external_boom").count() == 1


def test_a_retry_policy_retries_exceptions_and_counts_attempts():
    result = t.flaky.enqueue("k1", 2)
    run_until_idle()
    result.refresh()
    assert result.status == SUCCESSFUL
    assert result.return_value == {"attempt": 3, "errors": 2, "worker_ids": 3}
    assert [e.exception_class_path for e in result.errors] == ["builtins.ConnectionError"] * 2
    assert result.attempts == 3
    assert result.started_at < result.last_attempted_at


def test_a_retry_policy_gives_up_after_its_attempts():
    result = t.flaky.enqueue("k2", 5)
    run_until_idle()
    result.refresh()
    assert result.status == FAILED
    assert len(result.errors) == 3
    assert ProviderCall.objects.filter(action="task.flaky", effect_key="k2").count() == 3


def test_a_return_value_that_is_not_json_fails_the_task_with_a_type_error():
    result = t.returns_set.enqueue()
    run_until_idle()
    result.refresh()
    assert result.status == FAILED
    assert result.errors[0].exception_class_path == "builtins.TypeError"


@pytest.mark.parametrize("fn", [t.exits, t.interrupted], ids=["SystemExit", "KeyboardInterrupt"])
def test_system_exit_and_keyboard_interrupt_fail_the_task_and_the_worker_goes_on(fn):
    result = fn.enqueue()
    after = t.add.enqueue(1, 1)
    run_until_idle()
    result.refresh()
    assert result.status == FAILED
    assert result.errors[0].exception_class_path.endswith(("SystemExit", "KeyboardInterrupt"))
    assert t.add.get_result(after.id).return_value == 2


def test_async_tasks_run():
    result = t.aadd.enqueue(4, 5)
    run_until_idle()
    assert t.aadd.get_result(result.id).return_value == 9


def test_the_context_gives_the_result_and_the_attempt():
    result = t.context_info.enqueue()
    run_until_idle()
    value = t.context_info.get_result(result.id).return_value
    assert value["id"] == result.id
    assert value["attempt"] == 1
    assert value["status"] == str(RUNNING)
    assert len(value["worker_ids"]) == 1 and value["worker_ids"][0]


def test_effect_key_is_the_steps_effect_key():
    result = t.record.enqueue("a")
    run_until_idle()
    call = ProviderCall.objects.get(action="task.record")
    assert call.effect_key == f"{result.id}:0"
    assert t.record.get_result(result.id).return_value == {"key": call.effect_key}
    with pytest.raises(ValueError, match="TaskContext"):
        effect_key(object())


def test_signals_are_sent_as_django_sends_them():
    seen: list[tuple[str, str, str]] = []

    def receiver(name):
        def record(sender, task_result, **kwargs):
            seen.append((name, task_result.id, str(task_result.status)))

        return record

    receivers = {name: receiver(name) for name in ("enqueued", "started", "finished")}
    signals_api.task_enqueued.connect(receivers["enqueued"])
    signals_api.task_started.connect(receivers["started"])
    signals_api.task_finished.connect(receivers["finished"])
    try:
        with transaction.atomic():
            result = t.add.enqueue(1, 2)
            assert seen == []  # not before the enqueue commits
        run_until_idle()
    finally:
        for name, fn in receivers.items():
            getattr(signals_api, f"task_{name}").disconnect(fn)
    assert seen == [
        ("enqueued", result.id, str(READY)),
        ("started", result.id, str(RUNNING)),
        ("finished", result.id, str(SUCCESSFUL)),
    ]


def test_priority_orders_claims_higher_first():
    low = t.add.using(priority=-10).enqueue(0, 1)
    high = t.add.using(priority=50).enqueue(0, 2)
    mid = t.add.enqueue(0, 3)
    order = [r.id for r in (high, mid, low)]
    run_until_idle()
    finished = sorted(order, key=lambda i: run(i).finished_at)
    assert finished == order


def test_run_after_delays_the_task():
    later = timezone.now() + dt.timedelta(hours=1)
    result = t.add.using(run_after=later).enqueue(1, 1)
    assert t.add.get_result(result.id).status == READY
    assert run(result.id).run_after >= later - dt.timedelta(seconds=1)


def test_queue_name_is_stored_on_the_run():
    result = t.mail.enqueue("a@example.com")
    assert run(result.id).queue == "mail"
    assert run(t.add.enqueue(1, 1).id).queue == "default"


def test_enqueue_many_inserts_thousands_in_a_few_round_trips():
    """Counted from libpq's trace: a handful of round trips for 3,000 calls (the runs and
    their budget accounts by one COPY each), not one statement per call."""
    from tests.hot_path.helpers import _round_trips

    calls = [((i, i), None) for i in range(3000)]
    with _round_trips() as counted:
        results = enqueue_many(t.add, calls)
    assert counted[0] <= 8, counted
    assert len(results) == 3000 and len({r.id for r in results}) == 3000
    assert WorkflowRun.objects.filter(pk__in=[r.id for r in results]).count() == 3000
    assert t.add.get_result(results[7].id).args == [7, 7]


def test_enqueue_many_validates_every_call_before_inserting_any():
    before = WorkflowRun.objects.count()
    with pytest.raises(InvalidTaskCall, match="arguments"):
        enqueue_many(t.add, [((1, 2), None), ((object(), 2), None)])
    assert WorkflowRun.objects.count() == before


def test_task_attempt_rows_hold_the_failures():
    result = t.boom.enqueue("x")
    run_until_idle()
    row = TaskAttempt.objects.get(run_id=result.id)
    assert row.attempt == 1 and row.worker_id


@pytest.mark.skipif(not EXTRA_ARGUMENTS, reason="Django 6.0's @task takes no effect= or retry=")
def test_decorating_with_an_unknown_effect_is_a_clear_error():
    with pytest.raises(InvalidTaskCall, match="effect must be one of"):
        task(effect="transactional")(t.noop.func)


def test_a_scheduled_task_runs_on_its_tasks_queue_with_its_priority_and_path(k2b_clock):
    """A schedule's tick starts the task's run as an enqueue does: its queue (which
    ``runworkflows --queue`` selects), its priority and its task path, not the
    defaults of a workflow run."""
    schedule_task(
        "mail-every-minute", t.mail, Schedule(every=dt.timedelta(minutes=1)), args=["a@x.org"]
    )
    k2b_clock.advance(minutes=1, seconds=1)
    assert schedule_passes.run_pass("default", {"k2b.task.pure": {1}}).started == 1
    ticked = WorkflowRun.objects.get(schedule_id="mail-every-minute")
    enqueued = run(t.mail.enqueue("b@x.org").id)
    for row in (ticked, enqueued):
        assert (row.queue, row.priority, row.task_path) == (
            "mail",
            105,
            "tests.tasks_app.tasks.mail",
        )
    run_until_idle(timeout=60)
    assert t.mail.get_result(str(ticked.pk)).return_value == {"sent": "a@x.org"}


def test_enqueue_many_runs_carry_their_tasks_queue_priority_and_seals():
    """The bulk rows are the rows an enqueue writes: the claim checks each run's start
    seal and chain anchors before running it, so every one running proves them."""
    results = enqueue_many(t.mail, [((f"{i}@x.org",), None) for i in range(5)])
    rows = WorkflowRun.objects.filter(pk__in=[r.id for r in results])
    assert {(r.queue, r.priority, r.task_path) for r in rows} == {
        ("mail", 105, "tests.tasks_app.tasks.mail")
    }
    assert all(seals.start_problem(r) is None for r in rows)
    run_until_idle(timeout=60)
    assert [t.mail.get_result(r.id).return_value for r in results] == [
        {"sent": f"{i}@x.org"} for i in range(5)
    ]


def test_enqueue_many_refuses_to_copy_a_column_new_run_makes_per_run(monkeypatch):
    """A column ``new_run`` sets per run, that the bulk path would copy from one run into
    every row, stops the bulk start before anything is inserted."""
    built = starts.new_run

    def with_a_per_run_column(*args, **kwargs):
        row = built(*args, **kwargs)
        row.error_message = str(uuid.uuid4())
        return row

    monkeypatch.setattr(starts, "new_run", with_a_per_run_column)
    before = WorkflowRun.objects.count()
    with pytest.raises(AssertionError, match="error_message"):
        enqueue_many(t.add, [((1, 2), None), ((3, 4), None)])
    assert WorkflowRun.objects.count() == before


def test_enqueue_many_copies_a_json_column_new_run_makes_the_same_for_every_run(monkeypatch):
    """A JSON column equal in every run (a trace context, a principal) is not mistaken
    for one that differs per run, and every row carries it, under its seal."""
    built = starts.new_run

    def with_a_principal(*args, **kwargs):
        kwargs["principal"] = {"user": 7}
        return built(*args, **kwargs)

    monkeypatch.setattr(starts, "new_run", with_a_principal)
    results = enqueue_many(t.add, [((1, 2), None), ((3, 4), None)])
    rows = WorkflowRun.objects.filter(pk__in=[r.id for r in results])
    assert [r.principal for r in rows] == [{"user": 7}] * 2
    assert all(seals.start_problem(r) is None for r in rows)


def test_enqueue_many_refuses_rows_sealed_otherwise_than_new_run_seals(monkeypatch):
    monkeypatch.setattr(
        seals, "start_seal_like", lambda template, run_id, value, **fairness: "k:forged"
    )
    before = WorkflowRun.objects.count()
    with pytest.raises(AssertionError, match="other than new_run"):
        enqueue_many(t.add, [((1, 2), None)])
    assert WorkflowRun.objects.count() == before


def test_enqueue_many_wakes_listening_workers_once_it_commits():
    """Each queued row's trigger still notifies the workers' channel, and only once the
    enqueue commits: an idle worker wakes for a bulk enqueue as for an enqueue."""
    import psycopg
    from django.db import connection

    from k2b_workflows.store import CHANNEL
    from k2b_workflows.tasks.names import TASK_APP_ID

    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        with transaction.atomic():
            enqueue_many(t.add, [((i, i), None) for i in range(50)])
            assert [n.payload for n in listener.notifies(timeout=0.3)] == []
        assert [n.payload for n in listener.notifies(timeout=2.0, stop_after=1)] == [TASK_APP_ID]


def test_enqueue_many_leaves_a_transactions_own_trigger_ignore_list_as_it_was():
    """The bulk start sets ``pgtrigger.ignore`` to the empty list (triggers skip an
    exception each) only where the transaction has none: a list of the caller's stays."""
    from django.db import connection

    def ignore_setting() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('pgtrigger.ignore', true)")
            return cursor.fetchone()[0]

    with transaction.atomic():
        enqueue_many(t.add, [((1, 2), None)])
        assert ignore_setting() == "{}"
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('pgtrigger.ignore', '{some_trigger}', true)")
        enqueue_many(t.add, [((1, 2), None)])
        assert ignore_setting() == "{some_trigger}"
    assert ignore_setting() in (None, "")


def test_enqueue_many_builds_each_input_as_enqueue_does():
    """The bulk path encodes the task's part once and each call's arguments alone: the
    inputs stored are those ``run_input`` builds for the same calls."""
    backend = t.add.get_backend()
    calls = [
        ((1, 2.5), None),
        ([[1, {"b": "é"}], 1e16], {}),
        ((), {"a": [None, True, -0.0], "b": 1}),
    ]
    results = enqueue_many(t.add, calls)
    for result, (args, kwargs) in zip(results, calls, strict=True):
        assert run(result.id).input == backend.run_input(t.add, args, kwargs)


def test_tasks_enqueued_on_a_paused_queue_are_accepted_and_run_once_it_is_resumed():
    """#49: the enqueue and ``enqueue_many`` go in; no claim takes them until the resume."""
    pause_queue("mail", reason="the mail provider is down")
    one = t.mail.enqueue("a@x.org")
    many = enqueue_many(t.mail, [(["b@x.org"], {}), (["c@x.org"], {})])
    other = t.add.enqueue(2, 3)
    run_until_idle(timeout=60)
    assert t.add.get_result(other.id).status == SUCCESSFUL
    assert {t.mail.get_result(r.id).status for r in (one, *many)} == {READY}
    resume_queue("mail")
    run_until_idle(timeout=60)
    assert {t.mail.get_result(r.id).status for r in (one, *many)} == {SUCCESSFUL}


def test_a_failed_task_is_logged_once_with_its_own_exception_not_the_kernels(caplog):
    """Django logs a failed task with ``logger.exception``: the exception it reads is the
    task's, with the task's frames, scrubbed as every stored error is (#51)."""
    import logging

    with caplog.at_level(logging.INFO):
        result = t.boom.enqueue("password=hunter2 went wrong")
        run_until_idle()
    finished = [
        r
        for r in caplog.records
        if r.name.split(".")[0] in ("django", "django_tasks") and "state=FAILED" in r.getMessage()
    ]
    assert len(finished) == 1, [r.getMessage() for r in finished]
    record = finished[0]
    assert result.id in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0] is ValueError
    text = logging.Formatter().format(record)
    assert "tests/tasks_app/tasks.py" in text  # the task's own frame
    assert "k2b_workflows/kernel" not in text and "StepFailed" not in text
    assert "_send_finished" not in text
    assert "hunter2" not in text
