"""Durable workflows on PostgreSQL that never repeat an external effect that may have happened.

The public API, re-exported flat: import from here, not from the modules.
Names that need the models resolve on first access (PEP 562), so importing
the package never touches the app registry before Django is set up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import moved
from .actions import (
    Action,
    Dependency,
    Effect,
    StepContext,
    ambiguous,
    failed,
    succeeded,
    unknown,
    waiting,
)
from .exceptions import (
    DatabaseNotMigrated,
    EvidenceChanged,
    ForkRefused,
    IdempotencyConflict,
    InvalidInput,
    InvalidSchedule,
    LeaseLost,
    NotRetryable,
    ResolutionRefused,
    RunCanceled,
    RunEndNotSealed,
    StepFailed,
    UnknownWorkflow,
)
from .fairness import Fairness
from .limits import Concurrency, RateLimit
from .retries import Retry
from .schedules import Schedule
from .unique import Unique
from .workflows import workflow

# Modules that moved into admin/ and worker/ stay importable by their old
# paths, with a deprecation warning, for one release (``moved.MOVED``).
moved.install()

_LAZY = {
    "EFFECT_ABSENT": "control",
    "EFFECT_CONFIRMED": "control",
    "cancel_workflow_run": "control",
    "count_child_workflow_runs": "control",
    "create_child_workflow_runs": "control",
    "fork_workflow_run": "control",
    "notify_workflow_worker": "control",
    "pause_queue": "control",
    "Progress": "progress",
    "progress_of": "progress",
    "set_progress": "progress",
    "paused_queues": "control",
    "resolve_effect": "control",
    "resume_queue": "control",
    "retry_workflow_run": "control",
    "start_workflow_run": "control",
    "wake_workflow_runs_waiting_on": "control",
    "acancel_workflow_run": "aio",
    "astart_workflow_run": "aio",
    "await_workflow_run": "results",
    "awake_workflow_runs_waiting_on": "aio",
    "wait_for_workflow_run": "results",
    "DryRunReport": "dryrun",
    "dry_run": "dryrun",
    "ai_provider": "kernel.ai",
    "schedule_workflow": "scheduling",
}

if TYPE_CHECKING:
    from .aio import acancel_workflow_run, astart_workflow_run, awake_workflow_runs_waiting_on
    from .control import (
        EFFECT_ABSENT,
        EFFECT_CONFIRMED,
        cancel_workflow_run,
        count_child_workflow_runs,
        create_child_workflow_runs,
        fork_workflow_run,
        notify_workflow_worker,
        pause_queue,
        paused_queues,
        resolve_effect,
        resume_queue,
        retry_workflow_run,
        start_workflow_run,
        wake_workflow_runs_waiting_on,
    )
    from .dryrun import DryRunReport, dry_run
    from .kernel.ai import ai_provider
    from .progress import Progress, progress_of, set_progress
    from .results import await_workflow_run, wait_for_workflow_run
    from .scheduling import schedule_workflow


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'k2b_workflows' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "EFFECT_ABSENT",
    "EFFECT_CONFIRMED",
    "Action",
    "Concurrency",
    "DatabaseNotMigrated",
    "Dependency",
    "DryRunReport",
    "Effect",
    "EvidenceChanged",
    "Fairness",
    "ForkRefused",
    "IdempotencyConflict",
    "InvalidInput",
    "InvalidSchedule",
    "LeaseLost",
    "NotRetryable",
    "Progress",
    "RateLimit",
    "ResolutionRefused",
    "Retry",
    "RunCanceled",
    "RunEndNotSealed",
    "Schedule",
    "StepContext",
    "StepFailed",
    "Unique",
    "UnknownWorkflow",
    "acancel_workflow_run",
    "ai_provider",
    "ambiguous",
    "astart_workflow_run",
    "await_workflow_run",
    "awake_workflow_runs_waiting_on",
    "cancel_workflow_run",
    "count_child_workflow_runs",
    "create_child_workflow_runs",
    "dry_run",
    "failed",
    "fork_workflow_run",
    "notify_workflow_worker",
    "pause_queue",
    "paused_queues",
    "progress_of",
    "resolve_effect",
    "resume_queue",
    "retry_workflow_run",
    "schedule_workflow",
    "set_progress",
    "start_workflow_run",
    "succeeded",
    "unknown",
    "wait_for_workflow_run",
    "waiting",
    "wake_workflow_runs_waiting_on",
    "workflow",
]
