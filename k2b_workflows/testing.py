"""Helpers for users' own tests: run the real worker loop in the test's thread.

``run_until_idle`` claims and executes runs (and AI tasks) one at a time in
the calling thread, with the same kernel code as ``manage.py runworkflows``,
until nothing of the selected apps is runnable. Delayed retries are waited
for (they are part of "until idle"); waiting runs are not, unless their
deadline passes within ``timeout``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence

from . import store
from .kernel import ai, claim
from .kernel.execute import Execution
from .kernel.leases import LeaseKeeper
from .worker import Worker


def run_until_idle(
    *,
    app_ids: Sequence[str] | None = None,
    timeout: float = 60.0,
    wait_for_deadlines: bool = False,
    using: str | None = None,
) -> Counter[str]:
    """Execute runnable runs until none is left; returns counts of outcomes.

    Raises ``TimeoutError`` when work is still runnable after ``timeout`` seconds.
    """
    using = using or store.database()
    worker = Worker(app_ids=app_ids, using=using, listen=False)
    keeper = LeaseKeeper(using)
    keeper.start()
    stats: Counter[str] = Counter()
    deadline = time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"run_until_idle: still busy after {timeout} s ({dict(stats)})")
            worker._last_housekeeping = 0.0
            worker._housekeeping(0)
            runs, loaded, tasks = worker.claim(1)
            for run_id, generation in runs:
                execution = Execution(
                    run_id, generation, using=using, keeper=keeper, preloaded=loaded.get(run_id)
                )
                stats[execution.execute()] += 1
                stats["runs"] += 1
                stats["steps"] += execution.steps_executed
            for task in tasks:
                abort = threading.Event()
                keeper.track_task(task[0], task[1], abort)
                try:
                    stats["ai_" + ai.run_task(using, task, abort)] += 1
                finally:
                    keeper.untrack_task(task[0])
            if runs or tasks:
                continue
            if worker._pending():
                due = claim.next_due_in_ms(using) or 0
                time.sleep(min(max(due / 1000, 0.005), 0.2))
                continue
            if wait_for_deadlines and _next_deadline_ms(using) is not None:
                time.sleep(min(max((_next_deadline_ms(using) or 0) / 1000, 0.005), 0.2))
                continue
            return stats
    finally:
        keeper.stop()


def _next_deadline_ms(using: str) -> float | None:
    from django.db import connections

    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT EXTRACT(EPOCH FROM (min(wait_deadline) - statement_timestamp())) * 1000"
            " FROM k2b_run WHERE status = 'waiting' AND wait_deadline IS NOT NULL"
        )
        value = cursor.fetchone()[0]
    return None if value is None else max(0.0, float(value))
