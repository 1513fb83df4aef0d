"""Canceling a task call: ``cancel`` and ``is_cancel_requested`` (#49).

The failure this is built around: a cancel that cuts a call in the middle of
its work, or that ends the call's run at once and throws away a result its
function then returns, so that work done reads as work not done; and a cancel
that does not stop the retry queued a moment earlier. Here a call that has not
started never starts: it ends FAILED, its last error ``RunCanceled``. A call
that runs is *asked* (``kernel.interventions.request_cancel``): its worker's
lease keeper sees the request within a tick and the call reads it with
``is_cancel_requested(context)`` (an async pure or idempotent call gets
``CancelledError`` at its next await; an external call, once made, is never
cut). It decides: a normal return is its result (SUCCESSFUL), an error ends
it canceled (FAILED), and no attempt of it starts again, whatever its retry
policy, a crash or a lost lease (``Execution.execute``, ``RunEnding``).

``cancel_workflow_run`` of a task call does the same (``request_cancel``); a
workflow run that is running is asked alike, and ends canceled before its next
step. Only the timeout sweep ends a running run at once (``control.cancel_run``).
"""

from __future__ import annotations

import uuid
from typing import Any

from django.db import connections

from .. import settings, validation
from ..exceptions import InvalidInput
from ..kernel import interventions
from ..models import WorkflowRun
from .backend import WorkflowsBackend
from .compat import TaskResultDoesNotExist, tasks_api
from .names import EFFECT_OF_WORKFLOW
from .options import input_option
from .runs import running_calls

#: Whether a call was asked to stop, read from its run: for a context whose call does
#: not run in this process (a test's own ``TaskContext``, another worker's call).
_ASKED_SQL = """
SELECT cancel_requested_at IS NOT NULL OR status = 'canceled' FROM k2b_run WHERE id = %s
"""

#: The reason a cancel without one records.
DEFAULT_REASON = "canceled"


class TaskCallNotFound(TaskResultDoesNotExist):  # type: ignore[misc,valid-type]
    """``cancel()`` of an id that names no task call: Django's ``TaskResultDoesNotExist``,
    as ``get_result`` raises for the same id. ``result_id`` is the id as given."""

    def __init__(self, result_id: Any, why: str) -> None:
        super().__init__(f"cancel({result_id!r:.100}): {why}; nothing was canceled")
        self.result_id = result_id


def cancel(result_or_id: Any, reason: str = "") -> Any:
    """Cancel a task call (a ``TaskResult`` or its id); returns its ``TaskResult`` as it
    now stands.

    A call that has not started (READY, or queued for its next attempt) never
    runs: it ends FAILED, its last error ``RunCanceled``. A running call is
    asked, and its result still RUNNING here: ``is_cancel_requested(context)``
    turns true on its worker within a second, an async pure or idempotent task
    gets ``CancelledError`` at its next await, and no further attempt or retry
    of it starts. If its function then returns normally the call ends
    SUCCESSFUL (its work was done); if it raises, FAILED as canceled, never
    retried. A call that already ended is returned unchanged. ``reason`` is kept
    as the run's error message (``"canceled"`` if empty).
    """
    result_id = getattr(result_or_id, "id", result_or_id)
    if not isinstance(reason, str):
        raise InvalidInput(f"cancel(): reason must be a string, not {type(reason).__name__}")
    reason = reason.strip() or DEFAULT_REASON
    validation.long_text(reason, "the cancel reason")
    try:
        run_id = uuid.UUID(str(result_id))
    except (TypeError, ValueError, AttributeError):
        raise TaskCallNotFound(result_id, "not a task result id (a run's UUID)") from None
    using = settings.database()
    found = WorkflowRun.objects.using(using).filter(pk=run_id).values_list("workflow_name").first()
    if found is None:
        raise TaskCallNotFound(result_id, f"no task call {run_id}")
    name = found[0]
    if name not in EFFECT_OF_WORKFLOW:
        raise TaskCallNotFound(
            result_id,
            f"run {run_id} is a run of workflow {name!r}, not a task call "
            "(cancel_workflow_run() cancels a workflow run)",
        )
    try:
        interventions.request_cancel(using, run_id, reason)
    except WorkflowRun.DoesNotExist:  # purged between the two reads
        raise TaskCallNotFound(result_id, f"no task call {run_id}") from None
    return _backend_of(result_or_id, run_id).get_result(str(run_id))


def _backend_of(result_or_id: Any, run_id: uuid.UUID) -> Any:
    """The backend that reads the call's result: the given result's, else the alias its
    run was enqueued through, else any of this kind (they read a run alike)."""
    task = getattr(result_or_id, "task", None)
    if task is not None:
        return task.get_backend()
    run = WorkflowRun.objects.using(settings.database()).only("input").get(pk=run_id)
    try:
        backend = tasks_api.task_backends[input_option(run.input, "backend")]
    except Exception:  # the alias left TASKS since, or the input is not a task's
        backend = None
    if isinstance(backend, WorkflowsBackend):
        return backend
    for backend in tasks_api.task_backends.all():
        if isinstance(backend, WorkflowsBackend):
            return backend
    raise TaskCallNotFound(run_id, "no WorkflowsBackend in settings.TASKS reads it")


def is_cancel_requested(context: Any) -> bool:
    """Whether the call whose ``TaskContext`` this is was asked to stop (``cancel``).

    For a task declared ``takes_context=True``, to call between units of work:
    cheap (no query) on a worker, whose lease keeper sees a cancel within a
    second. True also once the call's run ended or left this worker under it
    (``cancel_workflow_run``, a lost lease, the action's timeout): whatever it
    returns then is not its result. Outside a worker the run is read.
    """
    result = getattr(context, "task_result", None)
    result_id = getattr(result, "id", None)
    if not isinstance(result_id, str):
        raise InvalidInput(
            "is_cancel_requested() takes the TaskContext of a task declared with "
            f"takes_context=True, not {type(context).__name__}"
        )
    ctx = running_calls.get(result_id)
    if ctx is not None:
        return bool(ctx.cancel_asked())
    try:
        run_id = uuid.UUID(result_id)
    except ValueError:
        return False
    with connections[settings.database()].cursor() as cursor:
        cursor.execute(_ASKED_SQL, [run_id])
        row = cursor.fetchone()
    return bool(row and row[0])
