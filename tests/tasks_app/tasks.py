"""django.tasks tasks the suite enqueues on ``k2b_workflows.tasks.WorkflowsBackend`` (#37).

Each records what it did in ``ProviderCall`` (committed at once: the "provider"),
with the effect key and the process id, so a test counts calls after crashes.
``crash`` names a point where the task kills its own process with SIGKILL when
``K2B_TEST_CRASH`` names the same point (``tests.workflows.crash_point``).
Django 6.1 and the backport pass ``effect=``/``retry=`` through ``@task``.
"""

from __future__ import annotations

import asyncio
import os
import time

from k2b_workflows import Retry
from k2b_workflows.tasks import effect_key
from tests.models import ProviderCall
from tests.workflows import crash_point

try:
    from django.tasks import TaskContext, task
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskContext, task  # type: ignore[no-redef]


def _call(action: str, key: str = "", payload=None) -> None:
    ProviderCall.objects.create(action=action, effect_key=key, pid=os.getpid(), payload=payload)


@task(effect="pure")
def add(a, b):
    return a + b


@task(effect="pure", priority=5, queue_name="mail")
def mail(to):
    _call("task.mail", payload={"to": to})
    return {"sent": to}


@task(takes_context=True, effect="idempotent")
def record(context: TaskContext, key, crash=None):
    """IDEMPOTENT: the provider sees the same effect key on every attempt."""
    _call("task.record", effect_key(context), {"key": key, "attempt": context.attempt})
    crash_point({"crash": crash}, "task_idempotent")
    return {"key": effect_key(context)}


@task(takes_context=True, effect="external")
def charge(context: TaskContext, order, crash=None):
    """EXTERNAL (also the backend's default): never called twice for one enqueue."""
    _call("task.charge", effect_key(context), {"order": order})
    crash_point({"crash": crash}, "task_external")
    return {"charged": order}


@task(takes_context=True)
def charge_default(context: TaskContext, order):
    """No effect declared: the backend's OPTIONS["effect"], else external."""
    _call("task.charge_default", effect_key(context), {"order": order})
    return order


@task(effect="pure")
def pure_crash(n, crash=None):
    _call("task.pure_crash", payload={"n": n})
    crash_point({"crash": crash}, "task_pure")
    return n * 2


@task(effect="pure")
def boom(message):
    _call("task.boom")
    raise ValueError(message)


@task(effect="external")
def external_boom(message):
    _call("task.external_boom")
    raise RuntimeError(message)


@task(takes_context=True, effect="pure", retry=Retry(max_attempts=3, backoff=0.01, jitter=False))
def flaky(context: TaskContext, key, failures):
    """Raises on its first ``failures`` attempts, then returns what it saw."""
    _call("task.flaky", key, {"attempt": context.attempt})
    if context.attempt <= failures:
        raise ConnectionError(f"attempt {context.attempt} failed")
    return {
        "attempt": context.attempt,
        "errors": len(context.task_result.errors),
        "worker_ids": len(context.task_result.worker_ids),
    }


@task(effect="pure")
def returns_set():
    return {1, 2, 3}


@task(effect="pure")
def exits():
    raise SystemExit(3)


@task(effect="pure")
def interrupted():
    raise KeyboardInterrupt


@task(effect="pure")
async def aadd(a, b):
    await asyncio.sleep(0)
    return a + b


@task(takes_context=True, effect="pure")
def context_info(context: TaskContext):
    result = context.task_result
    return {
        "id": result.id,
        "attempt": context.attempt,
        "worker_ids": result.worker_ids,
        "status": str(result.status),
    }


@task(effect="pure")
def sleepy(seconds):
    _call("task.sleepy")
    time.sleep(seconds)
    return seconds


@task(effect="pure")
def noop():
    return None


@task(effect="idempotent")
def idempotent_noop(n):
    return n


@task(effect="external")
def external_noop(n):
    return n


def impostor_target():
    """A plain function: wrapped by a test as a task it is not known as here."""
    return None
