"""Async twins of the control functions, for ASGI views and other async code.

The failure this guards against: calling ``start_workflow_run`` from a
coroutine either raises ``SynchronousOnlyOperation`` (Django refuses ORM
calls on the event loop's thread) or, wrapped by hand in a thread without
care, blocks the loop while PostgreSQL answers. Each twin takes the same
arguments and returns or raises the same as its original; the database work
runs in a thread through ``asgiref.sync.sync_to_async`` (thread-sensitive, as
Django's own async ORM methods), so the loop keeps serving other requests.
``await_workflow_run`` lives in ``results.py``: it waits without a thread.

Each twin spells out its original's parameters (a ``**kwargs`` pass-through
would hide them from type checkers and editors); the twin of
``start_workflow_run`` once lagged behind it, and refused ``concurrency_key``,
``priority`` and ``run_after`` with a TypeError.
``tests/kernel/test_results_async.py`` compares every pair's signature, so they
cannot drift apart again (#38).
"""

from __future__ import annotations

import uuid
from typing import Any

from asgiref.sync import sync_to_async

from . import control
from .models import WorkflowRun
from .results import await_workflow_run
from .unique import Unique


async def astart_workflow_run(
    name: str,
    input: Any,
    *,
    idempotency_key: str | None = None,
    principal: Any = None,
    parent: WorkflowRun | uuid.UUID | str | None = None,
    version: int | None = None,
    concurrency_key: str | None = None,
    priority: int = 0,
    run_after: Any = None,
    schedule_id: str | None = None,
    scheduled_for: Any = None,
    queue: str | None = None,
    unique: Unique | None = None,
    fairness_key: Any = None,
) -> WorkflowRun:
    """``start_workflow_run`` for async code: every argument, passed through by name."""
    return await sync_to_async(control.start_workflow_run)(
        name,
        input,
        idempotency_key=idempotency_key,
        principal=principal,
        parent=parent,
        version=version,
        concurrency_key=concurrency_key,
        priority=priority,
        run_after=run_after,
        schedule_id=schedule_id,
        scheduled_for=scheduled_for,
        queue=queue,
        unique=unique,
        fairness_key=fairness_key,
    )


async def acancel_workflow_run(run_id: uuid.UUID | str, reason: str) -> WorkflowRun:
    """``cancel_workflow_run`` for async code."""
    return await sync_to_async(control.cancel_workflow_run)(run_id, reason)


async def awake_workflow_runs_waiting_on(*, app_id: str, kind: str, key: str) -> int:
    """``wake_workflow_runs_waiting_on`` for async code."""
    return await sync_to_async(control.wake_workflow_runs_waiting_on)(
        app_id=app_id, kind=kind, key=key
    )


__all__ = [
    "acancel_workflow_run",
    "astart_workflow_run",
    "await_workflow_run",
    "awake_workflow_runs_waiting_on",
]
