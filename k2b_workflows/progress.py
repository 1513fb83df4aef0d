"""``set_progress`` and ``progress_of``: how far a running task call or workflow step got (#49).

The failure this is built around: a progress bar that lies or costs. Written
in the step's transaction, it rolls back with the step and shows nothing
until the step commits; written on every call of a tight loop, it turns a
run into thousands of writes a second. Here a value is checked on the
caller's thread (a bad one is refused there, naming what is wrong), then
written by the kernel's progress writer (``kernel/progress.py``) on a
connection of its own, at most a few times a second per run, the last value
always; it is kept after the run ends, deleted with the run by retention.

Progress is display: nothing a worker decides reads it.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

from . import settings
from .exceptions import InvalidInput
from .kernel import clock
from .kernel import progress as writer
from .models import WorkflowRun
from .models.progress import MAX_NOTE, RunProgress

#: The largest count a bar takes: PostgreSQL's bigint.
MAX_COUNT = 2**63 - 1


@dataclass(frozen=True)
class Progress:
    """A run's progress as its step last set it: ``done`` of ``total`` (None: unknown)."""

    done: int
    total: int | None
    note: str
    updated_at: dt.datetime

    @property
    def fraction(self) -> float | None:
        """``done / total`` between 0 and 1; None without a total (0 of 0 is done: 1.0)."""
        if self.total is None:
            return None
        return 1.0 if self.total == 0 else self.done / self.total


def set_progress(ctx_or_context: Any, done: int, total: int | None = None, note: str = "") -> None:
    """Say how far the running step got: ``done`` of ``total`` items, and a short note.

    ``ctx_or_context``: an action's ``ctx``, or the ``TaskContext`` of a task
    declared with ``takes_context=True``, while its step runs (a thread the
    step started may call it too). Call it as often as you like: at most a few
    writes a second reach the database, the last value always, on a
    connection of its own, so a step that fails or rolls back keeps the
    progress it reported. Raises ``InvalidInput`` naming what is wrong. In a
    dry run it checks its arguments and writes nothing.
    """
    done = _count("done", done)
    if total is not None:
        total = _count("total", total)
        if total < done:
            raise InvalidInput(
                f"set_progress(): total ({total}) must not be less than done ({done})"
            )
    if not isinstance(note, str):
        raise InvalidInput(f"set_progress(): note must be a str, not {type(note).__name__}")
    if len(note) > MAX_NOTE:
        raise InvalidInput(
            f"set_progress(): note is {len(note)} characters long; at most {MAX_NOTE} are kept"
        )
    if "\x00" in note:
        raise InvalidInput("set_progress(): note must not contain NUL characters")
    ctx = _running_step(ctx_or_context)
    if ctx is None:
        return
    writer.record(ctx, done, total, note, clock.now())


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"set_progress(): {name} must be an int, not {type(value).__name__}")
    if value < 0:
        raise InvalidInput(f"set_progress(): {name} must not be negative, not {value}")
    if value > MAX_COUNT:
        raise InvalidInput(f"set_progress(): {name} must be at most {MAX_COUNT}")
    return value


def _running_step(obj: Any) -> Any:
    """The step context ``obj`` stands for, running in this process; None in a dry run."""
    result = getattr(obj, "task_result", None)
    if result is not None:  # django.tasks' TaskContext
        ctx = writer.live_step(result.id)
        if ctx is None:
            raise InvalidInput(
                f"set_progress(): task call {result.id} is not running in this process: pass "
                "the TaskContext the running task received (takes_context=True)"
            )
        return ctx
    if hasattr(obj, "run_id") and hasattr(obj, "effect_key"):  # an action's ctx
        if getattr(obj, "dry_run", False):
            return None
        if not writer.is_live(obj):
            raise InvalidInput(
                f"set_progress(): the ctx of step {getattr(obj, 'step', '?')} of run "
                f"{obj.run_id} is not running: its step has ended (pass the ctx of the hook "
                "that is running)"
            )
        return obj
    raise InvalidInput(
        "set_progress() takes a running action's ctx or a running task's TaskContext "
        f"(@task(takes_context=True)), not {type(obj).__name__}"
    )


def progress_of(result_or_id: Any) -> Progress | None:
    """The progress a run's step last set, or None if none was ever set.

    ``result_or_id``: a ``TaskResult``, a ``WorkflowRun``, or a run's id (a
    ``UUID`` or its text). Kept after the run ends; what is read is what the
    writer has written, a fraction of a second behind the step at most.
    """
    run_id, using = _run_id(result_or_id)
    row = RunProgress.objects.using(using).filter(run_id=run_id).first()
    if row is None:
        return None
    return Progress(done=row.done, total=row.total, note=row.note, updated_at=row.updated_at)


def _run_id(obj: Any) -> tuple[uuid.UUID, str]:
    if isinstance(obj, WorkflowRun):
        return obj.pk, obj._state.db or settings.database()
    if isinstance(obj, uuid.UUID):
        return obj, settings.database()
    value = obj if isinstance(obj, str) else getattr(obj, "id", None)  # a TaskResult's id
    if not isinstance(value, str):
        raise InvalidInput(
            f"progress_of() takes a TaskResult, a WorkflowRun or a run id, not {type(obj).__name__}"
        )
    try:
        return uuid.UUID(value), settings.database()
    except ValueError:
        raise InvalidInput(f"progress_of(): {value!r} is not a run id") from None
