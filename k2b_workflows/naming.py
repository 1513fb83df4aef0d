"""The names a run is known by: its workflow's, or for a django.tasks call its task's path.

Every task call is a run of one of three workflows, ``k2b.task.<effect>``,
which say nothing of the task: a screen, a command's output, a log line or a
metric that named a task call by its workflow hid it (#51). ``display_name``
is the one name they all give a run or a schedule.

Below the models and the kernel, which name runs too, and without any import:
``k2b_workflows.tasks.names`` gives these names to code that must not import
django.tasks (#48).
"""

from __future__ import annotations

from typing import Any

#: The effects a task may declare, in the order error messages list them.
EFFECT_NAMES = ("pure", "idempotent", "external")
#: Every task workflow's name starts so: ``k2b.task.<effect>``.
TASK_WORKFLOW_PREFIX = "k2b.task."
WORKFLOW_NAMES = {effect: f"{TASK_WORKFLOW_PREFIX}{effect}" for effect in EFFECT_NAMES}
EFFECT_OF_WORKFLOW = {name: effect for effect, name in WORKFLOW_NAMES.items()}


def is_task_workflow(workflow_name: str) -> bool:
    """Whether runs of ``workflow_name`` are django.tasks task calls."""
    return workflow_name.startswith(TASK_WORKFLOW_PREFIX)


def display_name(workflow_name: str, task_path: str | None = "") -> str:
    """The name a run or a schedule is shown by: its task's path for a task call,
    its workflow's name otherwise.

    A task run without a path (a row written before the column existed) keeps its
    workflow's name rather than none.
    """
    if task_path and is_task_workflow(workflow_name):
        return task_path
    return workflow_name


def described_name(workflow_name: str, task_path: str | None = "") -> str:
    """``display_name``, saying what a task call is where there is room: a page's
    title, a run's detail. ``myapp.tasks.charge (task, external)``."""
    name = display_name(workflow_name, task_path)
    effect = EFFECT_OF_WORKFLOW.get(workflow_name)
    if effect is None or name == workflow_name:
        return name
    return f"{name} (task, {effect})"


def input_task_path(input: Any) -> str:
    """The task path in a task run's or a task schedule's input ("" if none): a
    schedule has no column for it, its input is the call its ticks enqueue."""
    path = input.get("task") if isinstance(input, dict) else None
    return path if isinstance(path, str) else ""
