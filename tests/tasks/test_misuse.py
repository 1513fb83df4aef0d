"""Bad input to the django.tasks backend (#37): each a clear error naming what is wrong,
raised before anything is inserted."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.exceptions import ImproperlyConfigured

from k2b_workflows import Concurrency, Retry, validation
from k2b_workflows.exceptions import InvalidInput
from k2b_workflows.models import WorkflowRun
from k2b_workflows.taskruns import InvalidTask
from k2b_workflows.tasks import InvalidTaskCall, WorkflowsBackend, enqueue_many
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
    [((object(),), {}), ((1,), {"b": {1, 2}}), ((float("nan"),), {})],
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
