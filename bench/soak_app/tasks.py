"""The soak's django.tasks tasks: one per effect, each call recorded where the soak counts it.

Each call of a task's function writes a row of ``soak_task_call`` through the
provider's connection (autocommit: the provider is another system) as it
enters, and stamps ``left_at`` on it as it returns: the run it belongs to, its
``effect_key``, the process and the fence generation it ran under. A write that
loses its connection (a restart, a terminated backend) is tried again under a
token of the call's own, so a retried write never counts as a second call: two
rows for one external call are two calls of its function. The soak then checks
an external call's rows (at most one), an idempotent call's effect keys (one),
and that no two calls of one external task were inside its function at once.

Each task sits on the ``TASKS`` alias of its effect (``bench/soak_app/settings.py``).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from bench.soak_app.workflows import pause, provider_write
from k2b_workflows.taskruns import current_step
from k2b_workflows.tasks import effect_key

try:
    from django.tasks import TaskContext, task
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskContext, task  # type: ignore[no-redef]

ENTER = """INSERT INTO soak_task_call
    (token, effect, call, run_id, effect_key, generation, pid) VALUES (%s, %s, %s, %s, %s, %s, %s)
    ON CONFLICT (token) DO NOTHING"""
LEAVE = "UPDATE soak_task_call SET left_at = clock_timestamp() WHERE token = %s"


def called(effect: str, context: Any, call: int) -> int:
    """One call of a task's function: enter, pause, leave; returns ``call + 1``."""
    step = current_step.get()
    token = uuid.uuid4().hex
    key = effect_key(context)
    generation = getattr(step, "generation", None)
    pause()
    provider_write(
        ENTER, [token, effect, call, context.task_result.id, key, generation, os.getpid()]
    )
    pause()
    provider_write(LEAVE, [token])
    return call + 1


@task(backend="pure", takes_context=True)
def tally(context: TaskContext, call: int) -> int:
    """PURE: may run again after a crash; every run is recorded."""
    return called("pure", context, call)


@task(backend="idempotent", takes_context=True)
def notify(context: TaskContext, call: int) -> int:
    """IDEMPOTENT: may run again, always with the same ``effect_key``."""
    return called("idempotent", context, call)


@task(backend="external", takes_context=True)
def charge(context: TaskContext, call: int) -> int:
    """EXTERNAL: never called twice for one enqueue; cut mid-call, an incident."""
    return called("external", context, call)


#: Iterations of ``sum(range(n))`` per second in this process, once measured.
_rate: float | None = None

FIRST_HOLD = "INSERT INTO soak_hog (run_id) VALUES (%s) ON CONFLICT DO NOTHING"


def hold_the_gil(seconds: float) -> None:
    """Hold the GIL for about ``seconds`` in one C call, as a C extension does (a regex,
    a large JSON document, numpy without ``nogil``): no other thread of this process
    runs meanwhile, the lease keeper and the heartbeat included."""
    global _rate
    if _rate is None:
        t0 = time.perf_counter()
        sum(range(200_000))
        _rate = 200_000 / max(time.perf_counter() - t0, 1e-6)
    sum(range(int(_rate * seconds)))


@task(backend="pure", takes_context=True)
def crunch(context: TaskContext, call: int, ms: int) -> int:
    """PURE and CPU-bound: starves its own worker's other threads for ``ms`` (the
    starvation soak). Only its first run does: a takeover must not pass the hog on."""
    from django.db import connections

    with connections["provider"].cursor() as cursor:
        cursor.execute(FIRST_HOLD, [context.task_result.id])
        first = cursor.rowcount == 1
    if first:
        hold_the_gil(ms / 1000)
    return called("pure", context, call)


#: The tasks the harness enqueues, by effect.
TASKS = {"pure": tally, "idempotent": notify, "external": charge}
