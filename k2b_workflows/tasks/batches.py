"""Batches of task calls with callbacks: ``enqueue_batch`` and ``batch_status`` (#50).

The failure this is built around: a batch's callback that runs before the
batch is done, twice, or never (a crash between a member's end and the
batch's bookkeeping). The members are ``enqueue_many``'s runs, each carrying
its batch's id in its sealed input; the batch row holds the callbacks, built
and checked here, at the call, so that a callback a worker could not call
(not a task, not taking ``batch_id``) is refused in the caller's face rather
than when the last member ends. When the callbacks are enqueued, and why once,
is ``kernel/batches.py``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from django.db import transaction

from .. import settings as k2b_settings
from ..kernel import batches
from .backend import backend_of, call_inputs, check_binds, start_calls
from .exceptions import InvalidTaskArguments, InvalidTaskCall
from .options import task_path

__all__ = ["Batch", "BatchStatus", "batch_status", "enqueue_batch"]


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    """What ``enqueue_batch`` enqueued: the batch's id and its members' results, in order."""

    id: uuid.UUID
    results: list[Any]


class BatchStatus(NamedTuple):
    """A batch's members by state.

    ``ready``: queued, not started (a retry waiting for its backoff too);
    ``running``: started and not finished, a member that needs an operator
    included (it has not finished: the callbacks wait for it); ``successful``
    and ``failed`` (a canceled member failed). ``finished_at``: when the
    callbacks were enqueued, None until then.
    """

    total: int
    ready: int
    running: int
    successful: int
    failed: int
    finished_at: dt.datetime | None


def enqueue_batch(
    task: Any,
    calls: Iterable[tuple[Sequence[Any], dict[str, Any] | None]],
    *,
    on_success: Any = None,
    on_failure: Any = None,
    on_finish: Any = None,
) -> Batch:
    """Enqueue one call of ``task`` per ``(args, kwargs)`` as ``enqueue_many`` does, as a
    batch whose callbacks each run once, with the keyword argument ``batch_id``:
    ``on_finish`` when every member has finished (succeeded or failed; one that
    needs an operator has not), then ``on_success`` if all succeeded, or
    ``on_failure`` if any failed.

    In the caller's transaction: a rolled-back batch leaves nothing. Every call
    and callback is checked before anything is inserted.
    """
    backend = backend_of(task, "enqueue_batch")
    batch_id = uuid.uuid4()
    callbacks = {
        name: _callback(name, callback, batch_id)
        for name, callback in (
            ("on_finish", on_finish),
            ("on_success", on_success),
            ("on_failure", on_failure),
        )
        if callback is not None
    }
    inputs = call_inputs(backend, task, calls, "enqueue_batch")
    if not inputs:
        raise InvalidTaskCall(
            "enqueue_batch(): calls is empty: a batch needs at least one call "
            "(its callbacks run when its calls have finished, and it would have none)"
        )
    member_of = str(batch_id)
    inputs = [{**input, "batch": member_of} for input in inputs]
    using = k2b_settings.database()
    with transaction.atomic(using=using):
        batches.create(using, batch_id, task_path(task), len(inputs), callbacks)
        results = start_calls(backend, task, inputs)
    return Batch(id=batch_id, results=results)


def _callback(name: str, callback: Any, batch_id: uuid.UUID) -> dict[str, Any]:
    """The workflow and run input of callback ``name``: a task of this package's backend
    that takes ``batch_id``, checked now as its enqueue would check it."""
    backend = backend_of(callback, "enqueue_batch", name)
    backend.validate_task(callback)
    path = task_path(callback)
    kwargs = {"batch_id": str(batch_id)}
    try:
        check_binds(callback, path, (), kwargs)
    except InvalidTaskArguments as exc:
        raise InvalidTaskArguments(
            f"enqueue_batch(): {name} {path} is called with the keyword argument batch_id "
            f"alone, which it does not take: {exc}"
        ) from None
    input = backend.run_input(callback, (), kwargs)
    backend.check_cost(callback, input)
    return {"workflow": backend.options_of(callback).workflow_name, "input": input}


def batch_status(batch_id: uuid.UUID | str) -> BatchStatus:
    """The batch's members by state (one index walk over them) and when it finished."""
    try:
        key = uuid.UUID(str(batch_id))
    except (TypeError, ValueError, AttributeError):
        raise InvalidTaskCall(f"batch_status(): {batch_id!r:.100} is not a batch id") from None
    seen = batches.counts(k2b_settings.database(), key)
    if seen is None:
        raise InvalidTaskCall(f"batch_status(): no batch {key}")
    by = seen.by_status
    return BatchStatus(
        total=seen.total,
        ready=by.get("queued", 0) + by.get("waiting", 0),
        running=by.get("running", 0) + by.get("needs_attention", 0),
        successful=by.get("succeeded", 0),
        failed=by.get("failed", 0) + by.get("canceled", 0),
        finished_at=seen.finished_at,
    )
