"""Calling an action's hook, plain ``def`` or ``async def``, with the same guarantees.

The failure this guards against: an ``async def run()`` called like a plain
function returns a coroutine that never runs (the "effect" silently does not
happen, and the kernel sees an invalid result), or, run by hand with
``asyncio.run()`` inside a sync hook, cannot be interrupted when the run is
canceled, its lease is lost or the action's timeout passes.

Here a hook that returns a coroutine is run to completion on an event loop of
the worker thread's own (``asyncio.run``: a fresh loop per call, nothing
shared between steps), while the loop watches ``ctx.abort``, the abort
signal the lease keeper sets when the run ended under it (a timeout, an
operator's end), its lease was lost or the action's timeout passed (a
cancel that only asks the run to stop, #49, cuts no hook). When it is set
the task is cancelled (``CancelledError`` inside the hook, at its next
``await``) and whatever the hook does afterwards is
discarded: the call raises ``LeaseLost``, which every effect path already
handles as a stop (an EXTERNAL step's dispatch stays open, its evidence
noted, and is never run again blindly). The action's timeout is also
watched here, on the kernel's clock: past it the task is cancelled and the
call raises ``HookTimedOut``, an ordinary exception, which each effect class
treats as it treats an exception from its hook (a retry for PURE and
IDEMPOTENT, an unknown outcome to reconcile after an EXTERNAL dispatch)
without waiting for the lease to run out. Fencing is unchanged: every write
the kernel makes after the hook is fenced as after a sync hook.

The hook's own I/O must not block the loop; Django's ORM inside a coroutine
needs its async API (``acreate``, ``aget``) or ``sync_to_async``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from ..exceptions import LeaseLost
from . import clock

#: How often the loop looks at the abort signal while a coroutine runs.
WATCH_INTERVAL_S = 0.02


class HookTimedOut(Exception):
    """An async hook ran past its action's timeout and was cancelled."""


def call(hook: Callable[..., Any], ctx: Any, input: Any, timeout_s: float | None = None) -> Any:
    """``hook(ctx, input)``; a coroutine it returns is awaited (``run_coroutine``)."""
    result = hook(ctx, input)
    if inspect.iscoroutine(result):
        return run_coroutine(result, ctx.abort, timeout_s)
    return result


def run_coroutine(
    coro: Coroutine[Any, Any, Any],
    canceled: threading.Event,
    timeout_s: float | None = None,
    asked: threading.Event | None = None,
) -> Any:
    """Run ``coro`` on a loop of this thread; cancel it when ``canceled`` is set or
    ``timeout_s`` (kernel clock) has passed.

    ``asked``: set when the call was asked to stop (``tasks.cancel``, #49). The
    coroutine then gets ``CancelledError`` at its next await, once, and what it
    does with it is its answer: a value it returns is its result, the error it
    raises (``CancelledError`` itself if it lets it through) its failure.
    """
    deadline = None if timeout_s is None else clock.monotonic() + timeout_s
    return asyncio.run(_supervise(coro, canceled, deadline, timeout_s, asked))


async def _stop(task: asyncio.Future[Any]) -> None:
    task.cancel()
    # Let it run its cleanup; whatever it returns now is late and discarded.
    with contextlib.suppress(BaseException):
        await task


async def _supervise(
    coro: Coroutine[Any, Any, Any],
    canceled: threading.Event,
    deadline: float | None,
    timeout_s: float | None,
    asked: threading.Event | None = None,
) -> Any:
    task = asyncio.ensure_future(coro)
    while not task.done():
        if asked is not None and asked.is_set():
            task.cancel()
            asked = None  # asked once: a coroutine that goes on is let go on
        if deadline is not None and clock.monotonic() >= deadline:
            await _stop(task)
            raise HookTimedOut(f"the async hook ran past its timeout ({timeout_s} s)")
        if canceled.is_set():
            await _stop(task)
            raise LeaseLost(
                "the async hook was cancelled: the run was canceled, its lease lost or "
                "the action's timeout passed"
            )
        await asyncio.wait({task}, timeout=WATCH_INTERVAL_S)
    return task.result()
