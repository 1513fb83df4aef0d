"""A task's options (#48): one ``TaskOptions``, read once per task, written to its run's
input and read back by the same fields."""

from __future__ import annotations

import dataclasses

import pytest

from k2b_workflows.tasks import WorkflowsTask
from k2b_workflows.tasks.compat import base_api
from k2b_workflows.tasks.options import DECLARED, TaskOptions, input_option
from tests.tasks_app import tasks as t
from tests.tasks_app import timed

TASKS = [
    timed.bounded,
    timed.stops,
    timed.asked,
    timed.slow_external,
    t.add,
    t.mail,
    t.record,
    t.charge,
    t.charge_default,
    t.charge_then_raise,
    t.flaky,
    t.one_at_a_time,
    t.budgeted_charge,
    t.budgeted_flaky,
]


@pytest.mark.parametrize("task", TASKS, ids=lambda task: task.func.__name__)
def test_what_the_worker_reads_back_writes_the_same_input(task):
    options = task.get_backend().options_of(task)
    input = options.to_input()
    assert input == task.get_backend().declared_input(task)
    read = TaskOptions.from_input(input, options.effect)
    assert read.to_input() == input
    assert read.workflow_name == options.workflow_name
    assert input_option(input, "priority") == task.priority


def test_a_tasks_options_are_read_once():
    backend = t.add.get_backend()
    assert backend.options_of(t.add) is backend.options_of(t.add)
    moved = t.add.using(priority=7)
    assert backend.options_of(moved).priority == 7
    assert backend.options_of(t.add).priority == t.add.priority


def test_every_declared_option_is_an_argument_of_task():
    """A new field of ``TaskOptions`` with a check is a field of ``WorkflowsTask`` too:
    ``@task(name=...)`` on Django 6.1 and the backport, as ``OPTIONS[name]`` on 6.0."""
    djangos = {field.name for field in dataclasses.fields(base_api.Task)}
    ours = {field.name for field in dataclasses.fields(WorkflowsTask)} - djangos
    assert set(DECLARED) == ours
