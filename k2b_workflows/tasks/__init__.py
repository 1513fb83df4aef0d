"""django.tasks on k2b_workflows, the backend ``k2b_workflows.tasks.WorkflowsBackend``.

A task call is a run of one of three one-step workflows, chosen by the
task's effect. The package holds, a module each:

- ``backend``: the backend (``WorkflowsBackend``, ``WorkflowsTask``) and the
  enqueue paths (``enqueue``, ``enqueue_many``, ``schedule_task``);
- ``batches``: ``enqueue_batch`` and ``batch_status``, calls with callbacks;
- ``options``: ``TaskOptions``, every option of a task, read once from the
  task and written to and read from its run's input;
- ``runs``: what a worker runs (the task's step, its attempts, its result);
- ``cancels``: canceling a call (``cancel``, ``is_cancel_requested``);
- ``names``: the task workflows' names, without Django, for the admin;
- ``compat``: django.tasks, or the ``django-tasks`` backport.

The names below resolve on first access (PEP 562): importing
``k2b_workflows.tasks.names`` must not import django.tasks, which a project
without tasks may not have.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import (
        MAX_RUN_AFTER,
        InvalidTaskArguments,
        InvalidTaskCall,
        TaskRunNotSealed,
        TaskTimeout,
        WorkflowsBackend,
        WorkflowsTask,
        effect_key,
        enqueue_many,
        schedule_task,
    )
    from .batches import Batch, BatchStatus, batch_status, enqueue_batch
    from .cancels import TaskCallNotFound, cancel, is_cancel_requested

__all__ = [
    "MAX_RUN_AFTER",
    "Batch",
    "BatchStatus",
    "InvalidTaskArguments",
    "InvalidTaskCall",
    "TaskCallNotFound",
    "TaskRunNotSealed",
    "TaskTimeout",
    "WorkflowsBackend",
    "WorkflowsTask",
    "batch_status",
    "cancel",
    "effect_key",
    "enqueue_batch",
    "enqueue_many",
    "is_cancel_requested",
    "schedule_task",
]


#: The package's modules: ``from k2b_workflows.tasks import names`` asks this module for
#: the attribute first, which must not import the backend (and django.tasks) to answer.
_MODULES = frozenset(
    {"backend", "batches", "cancels", "compat", "exceptions", "names", "options", "runs"}
)

#: Names of a module of their own, not the backend's.
_ELSEWHERE = {
    "cancel": "cancels",
    "is_cancel_requested": "cancels",
    "TaskCallNotFound": "cancels",
    "Batch": "batches",
    "BatchStatus": "batches",
    "batch_status": "batches",
    "enqueue_batch": "batches",
}


def __getattr__(name: str) -> Any:
    """The backend's names, ``__all__`` and the others ``tasks.py`` had before #48."""
    if name.startswith("__") or name in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    backend = importlib.import_module(f"{__name__}.{_ELSEWHERE.get(name, 'backend')}")
    try:
        value = getattr(backend, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value
