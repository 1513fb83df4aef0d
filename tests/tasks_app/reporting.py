"""Tasks that report their progress (#49).

``reports`` reports a first value, then stays inside its call until the test
releases it (``held.hold``), so a test reads its progress from another process
while the call certainly still runs.
"""

from __future__ import annotations

import asyncio
import time

from k2b_workflows import set_progress
from tests.tasks_app.held import hold
from tests.tasks_app.tasks import TaskContext, declared


@declared("pure", takes_context=True)
def reports(context: TaskContext, key, total):
    set_progress(context, 1, total, note="first item")
    hold(key)
    set_progress(context, total, total, note="all done")
    return total


@declared("pure", takes_context=True)
def reports_then_fails(context: TaskContext, done, total):
    set_progress(context, done, total, note="then it failed")
    raise RuntimeError("failed after reporting")


@declared("pure", takes_context=True)
def tight_loop(context: TaskContext, n, pause=0.0):
    """Reports each of ``n`` items, ``pause`` seconds apart (0: as fast as it can)."""
    for i in range(n + 1):
        set_progress(context, i, n, note=f"item {i}")
        if pause:
            time.sleep(pause)
    return n


@declared("pure", takes_context=True)
async def areports(context: TaskContext, n):
    for i in range(n + 1):
        set_progress(context, i, n, note="async")
        await asyncio.sleep(0)
    return n


@declared("pure", takes_context=True)
def misreports(context: TaskContext, done, total, note):
    """Reports what it is given: a bad value fails the call with the error it raised."""
    set_progress(context, done, total, note=note)
