"""Django's proposed task options on a real worker: ``max_attempts``, ``backoff``,
``timeout`` (django/new-features #142, #144; #49).

In-process (``run_until_idle``) on real PostgreSQL, with the test clock where a
delay is waited for: ``run_until_idle`` moves it to the next retry, so the clock's
offset at the end is the delays the calls waited.
"""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.exceptions import ImproperlyConfigured

from k2b_workflows import Retry, codes
from k2b_workflows.models import WorkflowRun
from k2b_workflows.tasks import InvalidTaskCall, TaskTimeout, WorkflowsBackend
from k2b_workflows.tasks.options import TaskOptions
from k2b_workflows.testing import controlled_clock, run_until_idle
from tests.models import ProviderCall
from tests.tasks_app import tasks as t
from tests.tasks_app import timed
from tests.tasks_app.tasks import EXTRA_ARGUMENTS, task

try:
    from django.tasks import TaskResultStatus
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskResultStatus  # type: ignore[no-redef]

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT_PATH = f"{TaskTimeout.__module__}.{TaskTimeout.__qualname__}"


def calls(action: str) -> int:
    return ProviderCall.objects.filter(action=action).count()


def classes(result) -> list[str]:
    return [error.exception_class_path for error in result.errors]


# -- max_attempts --------------------------------------------------------------------


def test_max_attempts_bounds_the_calls_exactly():
    result = timed.bounded.enqueue("a")
    run_until_idle()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert calls("timed.bounded") == 3
    assert classes(result) == ["builtins.ConnectionError"] * 3
    assert WorkflowRun.objects.get(pk=result.id).error_code == codes.WORKFLOW_RETRY_EXHAUSTED


def test_the_bound_is_the_sealed_retry_of_the_runs_input():
    """No counter of its own: ``max_attempts`` is ``Retry.max_attempts`` in the run's
    input (sealed with the run), counted by the kernel's sealed failure count (#47)."""
    result = timed.bounded.enqueue("a")
    run = WorkflowRun.objects.get(pk=result.id)
    assert run.input["retry"]["max_attempts"] == 3
    assert run.input["retry"]["backoff_s"] == 0
    assert "max_attempts" not in run.input


def test_max_attempts_one_retries_nothing():
    options = _options(max_attempts=1)
    assert options.retry is None


# -- backoff -------------------------------------------------------------------------


def test_a_backoff_that_returns_none_stops_the_retries():
    result = timed.stops.enqueue("a")
    run_until_idle()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert calls("timed.stops") == 2  # of five allowed
    run = WorkflowRun.objects.get(pk=result.id)
    assert run.error_code == codes.TASK_FAILED
    assert "its backoff returned None: not retried" in run.error_message


def test_a_number_backoff_is_a_constant_delay():
    with controlled_clock() as clock:
        result = timed.spaced.enqueue("a")
        run_until_idle()
    assert calls("timed.spaced") == 3
    # Two waits of 60 s each (less the real time the calls took): not doubled, no jitter.
    assert dt.timedelta(seconds=119) <= clock.offset < dt.timedelta(seconds=125)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED


def test_a_backoff_function_is_asked_with_the_exception_and_the_result():
    """A lambda on @task: the worker reads it from the task it imports. 100 s times the
    attempts so far: 100 s, then 200 s."""
    with controlled_clock() as clock:
        result = timed.asked.enqueue("a")
        run = WorkflowRun.objects.get(pk=result.id)
        run_until_idle()
    assert calls("timed.asked") == 3
    assert dt.timedelta(seconds=299) <= clock.offset < dt.timedelta(seconds=305)
    assert run.input["backoff"] == "task"


def test_a_backoff_that_raises_stops_the_retries_and_says_why():
    result = timed.buggy_backoff.enqueue("a")
    run_until_idle()
    run = WorkflowRun.objects.get(pk=result.id)
    assert (run.status, calls("timed.buggy_backoff")) == ("failed", 1)
    assert "its backoff raised RuntimeError: a bug in the backoff" in run.error_message


# -- timeout -------------------------------------------------------------------------


def test_a_pure_call_past_its_timeout_fails_with_task_timeout_and_is_retried():
    result = timed.slow_once.enqueue("a")
    run_until_idle()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL, result.errors
    assert result.return_value == 2  # the first attempt's late answer was not used
    assert classes(result) == [TIMEOUT_PATH]
    assert issubclass(TaskTimeout, TimeoutError)
    assert "ran past its timeout of 0.2 s" in result.errors[0].traceback


def test_an_idempotent_call_past_its_timeout_every_time_fails_after_its_attempts():
    result = timed.always_slow.enqueue("a")
    run_until_idle()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert calls("timed.always_slow") == 2
    assert classes(result) == [TIMEOUT_PATH] * 2


def test_an_async_call_is_cancelled_at_its_timeout():
    result = timed.slow_async.enqueue("a")
    run_until_idle(timeout=20)  # the coroutine sleeps a minute: cut long before
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert classes(result) == [TIMEOUT_PATH]
    assert calls("timed.slow_async.cancelled") == 1


def test_an_external_call_past_its_timeout_is_an_unknown_outcome_never_called_again():
    result = timed.slow_external.enqueue("a")
    run_until_idle()
    run = WorkflowRun.objects.get(pk=result.id)
    assert run.status == "needs_attention", (run.error_code, run.error_message)
    assert calls("timed.slow_external") == 1  # of three attempts allowed
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING
    assert classes(result) == [TIMEOUT_PATH]
    assert run_until_idle()["runs"] == 0
    assert calls("timed.slow_external") == 1


# -- using() and declarations ---------------------------------------------------------


def test_using_cannot_change_them():
    with pytest.raises(TypeError):
        timed.bounded.using(max_attempts=9)
    moved = timed.bounded.using(priority=7, queue_name="mail")
    options = moved.get_backend().options_of(moved)
    assert (options.retry.max_attempts, options.priority) == (3, 7)
    result = moved.enqueue("moved")
    run_until_idle()
    result.refresh()
    assert (result.status, calls("timed.bounded")) == (TaskResultStatus.FAILED, 3)


def _options(**declared):
    """The options of a pure task declaring ``declared``, as the backend reads them."""
    backend = WorkflowsBackend("x", {"BACKEND": "k2b_workflows.tasks.WorkflowsBackend"})
    values = {"effect": "pure", **declared}
    stand_in = type("T", (), {"func": t.noop.func, "queue_name": "default", "priority": 0})()
    for name, value in values.items():
        setattr(stand_in, name, value)
    return TaskOptions.of(stand_in, "x", backend.defaults)


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        ({"max_attempts": 0}, "max_attempts must be an int from 1"),
        ({"max_attempts": -2}, "max_attempts must be an int from 1"),
        ({"max_attempts": 2.5}, "max_attempts must be an int from 1"),
        ({"max_attempts": True}, "max_attempts must be an int from 1"),
        ({"max_attempts": 3, "backoff": -1}, "backoff must be seconds from 0"),
        ({"max_attempts": 3, "backoff": "soon"}, "is not a function's dotted path"),
        ({"max_attempts": 3, "backoff": [1, 2]}, "backoff must be seconds or a function"),
        ({"max_attempts": 3, "backoff": ValueError}, "backoff must be seconds or a function"),
        ({"timeout": 0}, "timeout must be seconds above 0"),
        ({"timeout": -5}, "timeout must be seconds above 0"),
        ({"timeout": "30"}, "timeout must be seconds above 0"),
        ({"backoff": 5}, "max_attempts=None allows none"),
        ({"max_attempts": 1, "backoff": 5}, "max_attempts=1 allows none"),
        (
            {"retry": Retry(max_attempts=3), "max_attempts": 3},
            r"retry=Retry\(...\) and max_attempts both",
        ),
        (
            {"retry": Retry(max_attempts=3), "max_attempts": 3, "backoff": 1},
            "and max_attempts and backoff both",
        ),
    ],
)
def test_bad_declarations_are_refused_naming_the_option_and_the_task(declared, message):
    with pytest.raises(InvalidTaskCall, match=message) as refused:
        _options(**declared)
    assert "task tests.tasks_app.tasks.noop" in str(refused.value)


@pytest.mark.skipif(not EXTRA_ARGUMENTS, reason="Django 6.0's @task takes no max_attempts=")
def test_a_bad_declaration_on_task_is_refused_when_the_task_is_made():
    with pytest.raises(InvalidTaskCall, match="max_attempts must be an int"):
        task(max_attempts=0)(t.noop.func)
    with pytest.raises(InvalidTaskCall, match="timeout must be seconds above 0"):
        task(timeout=-1)(t.noop.func)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_attempts": 0}, r"TASKS\['x'\]\['OPTIONS'\]: max_attempts must be"),
        ({"timeout": 0}, r"TASKS\['x'\]\['OPTIONS'\]: timeout must be"),
        ({"retry": Retry(max_attempts=2), "max_attempts": 2}, "both say how the task is retried"),
        ({"tasks": {"app.tasks.f": {"backoff": -1}}}, "backoff must be seconds"),
    ],
)
def test_bad_options_are_an_improperly_configured_backend(options, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        WorkflowsBackend(
            "x", {"BACKEND": "k2b_workflows.tasks.WorkflowsBackend", "OPTIONS": options}
        )


def test_options_declare_them_for_a_backends_tasks():
    backend = WorkflowsBackend(
        "x",
        {
            "BACKEND": "k2b_workflows.tasks.WorkflowsBackend",
            "OPTIONS": {"max_attempts": 4, "backoff": 2, "timeout": 30},
        },
    )
    stand_in = type("T", (), {"func": t.noop.func, "queue_name": "default", "priority": 0})()
    options = TaskOptions.of(stand_in, "x", backend.defaults)
    assert options.retry == Retry(
        max_attempts=4, backoff=2.0, max_backoff=2.0, jitter=False, multiplier=1
    )
    assert options.to_input()["timeout"] == 30.0


@pytest.mark.parametrize("name", sorted(timed.TIMED))
def test_django_60s_options_tasks_declare_the_same_as_task(name):
    """On Django 6.0 a bare @task gets these options from OPTIONS["tasks"]
    (tests/settings.py): the run's input is the one @task(...) writes."""
    declared = getattr(timed, name)
    backend = declared.get_backend()
    bare = type(
        "T", (), {"func": declared.func, "queue_name": "default", "priority": 0}
    )()  # declares nothing of its own
    from_settings = TaskOptions.of(bare, backend.alias, backend.defaults, backend.overrides)
    assert from_settings.to_input() == backend.options_of(declared).to_input()
