"""Bad input to the django.tasks backend (#37): each a clear error naming what is wrong,
raised before anything is inserted."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.core.exceptions import ImproperlyConfigured

from k2b_workflows import Concurrency, Retry, validation
from k2b_workflows.exceptions import InvalidInput
from k2b_workflows.models import WorkflowRun
from k2b_workflows.tasks import InvalidTaskCall, WorkflowsBackend, enqueue_many
from k2b_workflows.tasks.compat import InvalidTask
from tests.tasks_app import tasks as t
from tests.tasks_app.tasks import EXTRA_ARGUMENTS, declared

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task  # type: ignore[no-redef]

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_refusal_is_djangos_invalid_task_and_our_invalid_input():
    assert issubclass(InvalidTaskCall, InvalidTask)
    assert issubclass(InvalidTaskCall, InvalidInput)


def test_a_task_that_is_not_module_level_is_refused():
    with pytest.raises(InvalidTask, match="module level"):

        @declared("pure")
        def nested():
            return 1


def test_a_function_renamed_after_task_is_refused_at_enqueue(nothing_inserted):
    """The task path check: a worker finds a task by ``module.name``; a task whose
    function is known by another name there could never run."""
    hidden = declared("pure")(t.impostor_target)
    with pytest.raises(InvalidTaskCall, match="does not import back to this task"):
        hidden.enqueue()


def test_an_unknown_queue_is_refused(nothing_inserted):
    # On the alias that names its queues (on Django 6.0 ``add`` lives on an alias of
    # its effect, which takes any queue).
    with pytest.raises(InvalidTaskCall, match="nope"):
        t.add.using(queue_name="nope", backend="default").enqueue(1, 2)


@pytest.mark.parametrize("priority", [101, -101])
def test_a_priority_out_of_range_is_refused(priority, nothing_inserted):
    with pytest.raises(InvalidTaskCall, match="priority"):
        t.add.using(priority=priority).enqueue(1, 2)


def test_a_naive_run_after_is_refused_with_use_tz(nothing_inserted):
    with pytest.raises(InvalidTaskCall, match="run_after"):
        t.add.using(run_after=dt.datetime(2030, 1, 1)).enqueue(1, 2)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((object(), 1), {}), ((1,), {"b": {1, 2}}), ((float("nan"), 1), {})],
    ids=["object", "set", "nan"],
)
def test_arguments_that_are_not_json_are_refused(args, kwargs, nothing_inserted):
    with pytest.raises(InvalidTaskCall, match=r"arguments of task tests\.tasks_app\.tasks\.add"):
        t.add.enqueue(*args, **kwargs)


def test_enqueue_many_refuses_a_call_that_is_not_args_and_kwargs(nothing_inserted):
    with pytest.raises(InvalidTaskCall, match=r"call 1 must be \(args, kwargs\)"):
        enqueue_many(t.add, [((1, 2), None), (1, 2, 3)])


@pytest.mark.skipif(not EXTRA_ARGUMENTS, reason="Django 6.0's @task takes no effect= or retry=")
@pytest.mark.parametrize(
    ("retry", "message"),
    [
        (3, "must be a Retry"),
        (Retry(max_attempts=1), "retries nothing"),
        (Retry(max_attempts=3, non_retryable_codes=("X",)), "means nothing for a task"),
    ],
    ids=["not-a-retry", "one-attempt", "codes"],
)
def test_a_retry_that_makes_no_sense_for_a_task_is_refused(retry, message):
    with pytest.raises(InvalidInput, match=message):
        task(effect="pure", retry=retry)(t.noop.func)


@pytest.mark.skipif(not EXTRA_ARGUMENTS, reason="Django 6.0's @task takes no effect= or retry=")
def test_an_unknown_effect_is_refused():
    with pytest.raises(InvalidTaskCall, match="effect must be one of 'pure', 'idempotent'"):
        task(effect="transactional")(t.noop.func)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"effects": "pure"}, "unknown keys"),
        ({"effect": "maybe"}, "effect must be one of"),
        ({"retry": Retry(max_attempts=1)}, "retries nothing"),
        ({"concurrency": 1}, "concurrency must be a Concurrency"),
    ],
)
def test_bad_options_are_an_improperly_configured_backend(options, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        WorkflowsBackend(
            "x", {"BACKEND": "k2b_workflows.tasks.WorkflowsBackend", "OPTIONS": options}
        )


@pytest.mark.skipif(not EXTRA_ARGUMENTS, reason="Django 6.0's @task takes no concurrency=")
def test_a_concurrency_that_is_not_a_concurrency_is_refused():
    with pytest.raises(InvalidTaskCall, match="concurrency must be a Concurrency"):
        task(concurrency=1)(t.noop.func)


@pytest.mark.skipif(not EXTRA_ARGUMENTS, reason="Django 6.0's @task takes no concurrency=")
def test_enqueue_many_refuses_a_concurrency_that_decides_each_start_alone(nothing_inserted):
    """``cancel_newest`` counts the key's runs before each start: a bulk insert cannot."""
    newest = task(concurrency=Concurrency(limit=1, strategy="cancel_newest"))(t.noop.func)
    with pytest.raises(InvalidInput, match="start them one by one"):
        enqueue_many(newest, [((), None), ((), None)])


def test_a_task_workflow_started_without_a_task_call_is_refused():
    """The task workflows read their run's queue and task from the input: a start that
    is not an enqueue (``start_workflow_run`` by hand) says so instead of guessing."""
    from k2b_workflows import start_workflow_run

    before = WorkflowRun.objects.count()
    with pytest.raises(InvalidInput, match="enqueue the task"):
        start_workflow_run("k2b.task.pure", {"n": 1})
    assert WorkflowRun.objects.count() == before


def test_enqueue_many_refuses_a_call_too_large_only_with_its_tasks_part_as_enqueue_does(
    settings, nothing_inserted
):
    """enqueue_many checks the task's part of the input once and each call's arguments
    alone: a call whose arguments fit but whose whole input does not is still refused,
    with the error ``enqueue()`` gives for it."""
    backend = t.add.get_backend()
    declared = len(validation.CANONICAL_JSON.encode(backend.declared_input(t.add)).encode())
    settings.K2B_WORKFLOWS = {**settings.K2B_WORKFLOWS, "MAX_VALUE_BYTES": declared + 40}
    # The arguments alone as JSON: 16 and 36 bytes, both under 40.
    fits, too_large = ["x" * 10, 1], ["x" * 30, 1]
    with pytest.raises(InvalidTaskCall) as one:
        t.add.enqueue(*too_large)
    with pytest.raises(InvalidTaskCall) as many:
        enqueue_many(t.add, [(fits, None), (too_large, None)])
    assert str(many.value) == str(one.value) and "MAX_VALUE_BYTES" in str(one.value)


# -- the bad inputs of #47: each refused at the call, naming the argument ----------------------


def schedule_call(task, *args, **kwargs):
    """``schedule_task`` of one call, as the enqueues take it."""
    from k2b_workflows import Schedule
    from k2b_workflows.tasks import schedule_task

    return schedule_task(
        "misuse", task, Schedule(every=dt.timedelta(hours=1)), args=args, kwargs=kwargs
    )


def aenqueue(task, *args, **kwargs):
    from asgiref.sync import async_to_sync

    return async_to_sync(task.aenqueue)(*args, **kwargs)


#: Every path a call enters by: each goes through the same checks.
ENQUEUES = {
    "enqueue": lambda task, *a, **k: task.enqueue(*a, **k),
    "aenqueue": aenqueue,
    "enqueue_many": lambda task, *a, **k: enqueue_many(task, [(a, k)]),
    "schedule_task": schedule_call,
}


@pytest.fixture
def nothing_scheduled():
    from k2b_workflows.models import WorkflowSchedule

    yield
    assert not WorkflowSchedule.objects.exists()


@pytest.mark.parametrize("priority", ["5", True, 5.0, None], ids=["str", "bool", "float", "none"])
def test_a_priority_that_is_not_an_int_is_refused_naming_priority(priority, nothing_inserted):
    """Django compared ``'5' < -100`` itself and raised ``TypeError '<' not supported``."""
    refused = r"add: priority must be an int, not "
    if priority is not None:  # using() takes None as "unchanged"
        with pytest.raises(InvalidTaskCall, match=refused):
            t.add.using(priority=priority)
    with pytest.raises(InvalidTaskCall, match=refused):
        task(priority=priority)(t.add.func)


@pytest.mark.parametrize(
    "run_after",
    ["2030-01-01T00:00:00Z", 1_900_000_000, dt.date(2030, 1, 1)],
    ids=["str", "epoch", "date"],
)
def test_a_run_after_that_is_neither_a_datetime_nor_a_timedelta_is_refused(
    run_after, nothing_inserted
):
    with pytest.raises(InvalidTaskCall, match="run_after must be a datetime or a timedelta"):
        t.add.using(run_after=run_after)


def test_a_run_after_timedelta_is_a_delay_from_the_enqueue():
    from django.utils import timezone

    later = t.add.using(run_after=dt.timedelta(hours=2))
    before = timezone.now()
    run = WorkflowRun.objects.get(pk=later.enqueue(1, 2).id)
    after = timezone.now()
    assert before + dt.timedelta(hours=2) <= run.run_after <= after + dt.timedelta(hours=2)


def test_enqueue_many_takes_a_run_after_timedelta_too():
    from django.utils import timezone

    results = enqueue_many(t.add.using(run_after=dt.timedelta(minutes=5)), [((1, 2), None)])
    run = WorkflowRun.objects.get(pk=results[0].id)
    assert run.run_after > timezone.now() + dt.timedelta(minutes=4)


@pytest.mark.parametrize(
    ("run_after", "message"),
    [
        (dt.timedelta(seconds=-1), "must not be negative"),
        (dt.timedelta(days=3654), "more than 3653 days"),
        (dt.timedelta.max, "more than 3653 days"),
        (dt.datetime(9999, 12, 31, tzinfo=dt.UTC), "more than 3653 days"),
        (dt.datetime.max.replace(tzinfo=dt.UTC), "more than 3653 days"),
    ],
    ids=["negative", "over-ten-years", "timedelta-max", "year-9999", "datetime-max"],
)
def test_a_run_after_out_of_bounds_is_refused_naming_run_after(run_after, message):
    with pytest.raises(InvalidTaskCall, match=rf"add: run_after .*{message}"):
        t.add.using(run_after=run_after)


def test_a_run_after_nine_years_ahead_is_taken():
    from django.utils import timezone

    t.add.using(run_after=timezone.now() + dt.timedelta(days=9 * 365))
    t.add.using(run_after=dt.timedelta(days=3653))


def test_a_naive_run_after_says_what_django_requires(nothing_inserted):
    with pytest.raises(InvalidTaskCall, match="aware datetime while USE_TZ is on"):
        t.add.using(run_after=dt.datetime(2030, 1, 1))


def test_a_naive_run_after_is_local_time_without_use_tz(settings):
    """As Django's own backends take it: with ``USE_TZ`` off a naive datetime is
    the default time zone's."""
    from k2b_workflows.tasks.backend import _run_after

    settings.USE_TZ = False
    naive = dt.datetime(2030, 1, 1, 9)
    delayed = t.add.using(run_after=naive)
    assert _run_after(delayed.run_after).utcoffset() is not None


@pytest.mark.parametrize("how", ["function", "path"])
@pytest.mark.parametrize("caller", ["enqueue_many", "schedule_task"])
def test_a_function_or_a_path_in_place_of_a_task_is_refused_naming_task(
    how, caller, nothing_inserted, nothing_scheduled
):
    """Each raised ``AttributeError: get_backend``."""
    given = t.add.func if how == "function" else "tests.tasks_app.tasks.add"
    said = "decorate it with @task" if how == "function" else "import the task and pass it"
    with pytest.raises(
        InvalidTaskCall, match=rf"{caller}\(\): task must be a task made with @task"
    ):
        ENQUEUES[caller](given, 1, 2)
    with pytest.raises(InvalidTaskCall, match=said):
        ENQUEUES[caller](given, 1, 2)


@pytest.mark.parametrize("path", list(ENQUEUES))
@pytest.mark.parametrize(
    ("task", "args", "kwargs", "problem"),
    [
        (t.add, (1,), {}, "missing a required argument: 'b'"),
        (t.add, (1, 2, 3), {}, "too many positional arguments"),
        (t.add, (1, 2), {"c": 3}, "got an unexpected keyword argument 'c'"),
        (t.add, (1,), {"a": 2}, "multiple values for argument 'a'"),
        (t.record, (), {"crash": None}, "missing a required argument: 'key'"),
        (t.record, ("k", None, "x"), {}, "too many positional arguments"),
    ],
    ids=["short", "too-many", "unknown-keyword", "twice", "context-short", "context-too-many"],
)
def test_arguments_the_task_does_not_take_are_refused_at_the_call(
    path, task, args, kwargs, problem, nothing_inserted, nothing_scheduled
):
    """Bound to the function's signature at the call (the context a ``takes_context``
    task receives is not the caller's): accepted, ``add(1)`` failed on the worker."""
    from k2b_workflows.tasks import InvalidTaskArguments

    with pytest.raises(InvalidTaskArguments, match=re.escape(problem)) as caught:
        ENQUEUES[path](task, *args, **kwargs)
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, InvalidTaskCall)
    assert f"task {task.module_path}(" in str(caught.value)


def test_a_call_that_binds_is_taken_with_a_context_task_too():
    """The control: the context is not counted among the caller's arguments."""
    result = t.record.enqueue("k", crash=None)
    assert WorkflowRun.objects.get(pk=result.id).input["args"] == ["k"]


def test_a_string_for_queues_is_an_improperly_configured_backend_naming_queues():
    """Django made a set of its letters: ``{'d', 'e', 'f', 'a', 'u', 'l', 't'}``."""
    with pytest.raises(ImproperlyConfigured, match=r"TASKS\['x'\]\['QUEUES'\] must be a list"):
        WorkflowsBackend(
            "x", {"BACKEND": "k2b_workflows.tasks.WorkflowsBackend", "QUEUES": "default"}
        )


def test_a_tasks_schedule_refuses_an_input_instead_of_dropping_it(nothing_scheduled):
    from k2b_workflows import Schedule
    from k2b_workflows.tasks import schedule_task

    with pytest.raises(InvalidTaskCall, match=r"not Schedule\(input=\.\.\.\)"):
        schedule_task(
            "nightly", t.add, Schedule(every=dt.timedelta(days=1), input={"a": 1}), args=(1, 2)
        )
