"""django.tasks tasks the suite enqueues on ``k2b_workflows.tasks.WorkflowsBackend`` (#37).

Each records what it did in ``ProviderCall`` (committed at once: the "provider"),
with the effect key and the process id, so a test counts calls after crashes.
``crash`` names a point where the task kills its own process with SIGKILL when
``K2B_TEST_CRASH`` names the same point (``tests.workflows.crash_point``).
Django 6.1 and the backport pass ``effect=``/``retry=`` through ``@task``; on Django
6.0, whose ``@task`` takes no extra arguments, ``declared`` puts each task on the
backend alias whose ``OPTIONS`` say the same (tests/settings.py).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time

from k2b_workflows import Concurrency, Retry
from k2b_workflows.tasks import effect_key
from tests.models import ProviderCall
from tests.workflows import crash_point

try:
    from django.tasks import TaskContext, task
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskContext, task  # type: ignore[no-redef]


#: Django 6.1 and the backport pass @task's extra arguments to the backend's task class.
EXTRA_ARGUMENTS = "kwargs" in inspect.signature(task).parameters


def declared(
    effect: str | None = None,
    retry: Retry | None = None,
    concurrency: Concurrency | None = None,
    effect_budget: dict | None = None,
    cost=None,
    **options,
):
    """``@task(effect=..., retry=..., concurrency=..., effect_budget=..., cost=...,
    **options)``, or on Django 6.0 the alias that declares them in its ``OPTIONS``."""
    if EXTRA_ARGUMENTS:
        if effect is not None:
            options["effect"] = effect
        if retry is not None:
            options["retry"] = retry
        if concurrency is not None:
            options["concurrency"] = concurrency
        if effect_budget is not None:
            options["effect_budget"] = effect_budget
        if cost is not None:
            options["cost"] = cost
        return task(**options)
    if effect_budget is not None:
        return task(backend="budgeted_retrying" if retry else f"budgeted_{effect}", **options)
    if retry is not None:
        return task(backend="retrying", **options)
    if concurrency is not None:
        return task(backend="one_at_a_time", **options)
    return task(backend=effect or "default", **options)


def _call(action: str, key: str = "", payload=None) -> None:
    ProviderCall.objects.create(action=action, effect_key=key, pid=os.getpid(), payload=payload)


@declared("pure")
def add(a, b):
    return a + b


@declared("pure", priority=5, queue_name="mail")
def mail(to):
    _call("task.mail", payload={"to": to})
    return {"sent": to}


@declared("idempotent", takes_context=True)
def record(context: TaskContext, key, crash=None):
    """IDEMPOTENT: the provider sees the same effect key on every attempt."""
    _call("task.record", effect_key(context), {"key": key, "attempt": context.attempt})
    crash_point({"crash": crash}, "task_idempotent")
    return {"key": effect_key(context)}


@declared("external", takes_context=True)
def charge(context: TaskContext, order, crash=None):
    """EXTERNAL (also the backend's default): never called twice for one enqueue."""
    _call("task.charge", effect_key(context), {"order": order})
    crash_point({"crash": crash}, "task_external")
    return {"charged": order}


@declared("external")
def charge_keyless(order, crash=None):
    """EXTERNAL and keyless: it takes no context, so no effect key ever reaches the provider."""
    _call("task.charge_keyless", "", {"order": order})
    crash_point({"crash": crash}, "task_external")
    return {"charged": order}


@task(takes_context=True)
def charge_default(context: TaskContext, order):
    """No effect declared: the backend's OPTIONS["effect"], else external."""
    _call("task.charge_default", effect_key(context), {"order": order})
    return order


@declared("pure")
def pure_crash(n, crash=None):
    _call("task.pure_crash", payload={"n": n})
    crash_point({"crash": crash}, "task_pure")
    return n * 2


@declared("external")
def charge_fails_first(order):
    """Raises on its first call and charges on any later one: a provider's 503, or a bug
    fixed by a deploy, before an operator retries the failed call."""
    first = not ProviderCall.objects.filter(action="task.charge_fails_first").exists()
    _call("task.charge_fails_first", str(order))
    if first:
        raise RuntimeError("the provider answered 503")
    return {"charged": order}


@declared("idempotent", takes_context=True)
def keyed_fails_first(context: TaskContext, order):
    """IDEMPOTENT: sends its effect key to the provider, then raises on its first call."""
    first = not ProviderCall.objects.filter(action="task.keyed_fails_first").exists()
    _call("task.keyed_fails_first", effect_key(context), {"order": order})
    if first:
        raise RuntimeError("the provider timed out after taking the request")
    return {"charged": order}


@declared("pure", takes_context=True)
def fails_its_first_attempt(context: TaskContext):
    """Raises on attempt 1 and returns the attempt it is on any later one."""
    _call("task.fails_its_first_attempt", payload={"attempt": context.attempt})
    if context.attempt == 1:
        raise RuntimeError("first attempt")
    return context.attempt


@declared("external", takes_context=True)
def external_fails_its_first_attempt(context: TaskContext):
    """As ``fails_its_first_attempt``, an external call: each attempt is a dispatch."""
    _call("task.external_fails_its_first_attempt", payload={"attempt": context.attempt})
    if context.attempt == 1:
        raise RuntimeError("first attempt")
    return context.attempt


@declared("pure")
def boom(message):
    _call("task.boom")
    raise ValueError(message)


@declared("external")
def external_boom(message):
    _call("task.external_boom")
    raise RuntimeError(message)


#: The policy of ``flaky`` (on Django 6.0: the "retrying" alias's OPTIONS, the same).
RETRY = Retry(max_attempts=3, backoff=0.01, jitter=False)


#: Three attempts an hour apart: a test moves ``run_after`` to see them (#47).
RETRY_HOURLY = Retry(max_attempts=3, backoff=3600, jitter=False)


@declared("external", RETRY_HOURLY)
def charge_then_raise(order):
    """Charges, then raises: each attempt is one more charge, so the policy's bound is
    the only thing that stands between a retry loop and the card."""
    _call("task.charge_then_raise", str(order))
    raise RuntimeError("the provider's answer was lost")


@declared("pure", RETRY, takes_context=True)
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


@declared("pure")
def returns_set():
    return {1, 2, 3}


@declared("pure")
def exits():
    raise SystemExit(3)


@declared("pure")
def interrupted():
    raise KeyboardInterrupt


@declared("pure")
async def aadd(a, b):
    await asyncio.sleep(0)
    return a + b


@declared("pure", takes_context=True)
def context_info(context: TaskContext):
    result = context.task_result
    return {
        "id": result.id,
        "attempt": context.attempt,
        "worker_ids": result.worker_ids,
        "status": str(result.status),
    }


@declared("pure")
def sleepy(seconds):
    _call("task.sleepy")
    time.sleep(seconds)
    return seconds


@declared("pure")
def noop():
    return None


@declared("pure", concurrency=Concurrency(limit=1))
def one_at_a_time(n, seconds):
    """At most one call at a time across every worker: each call records its start and
    its end, so overlapping calls show as two starts in a row."""
    _call("task.one_at_a_time", payload={"n": n, "phase": "start"})
    time.sleep(seconds)
    _call("task.one_at_a_time", payload={"n": n, "phase": "end"})
    return n


@declared("idempotent")
def idempotent_noop(n):
    return n


@declared("external")
def external_noop(n):
    return n


@declared("external", takes_context=True)
def slow_charge(context: TaskContext, order, seconds):
    """EXTERNAL, slow: says it started; the provider sees the charge as the call ends (#47)."""
    _call("task.slow_charge.started", effect_key(context))
    time.sleep(seconds)
    _call("task.slow_charge", effect_key(context), {"order": order})
    return {"charged": order}


def impostor_target():
    """A plain function: wrapped by a test as a task it is not known as here."""
    return None


#: What one call of the budgeted tasks may charge (on Django 6.0: the OPTIONS of the
#: "budgeted_*" aliases, tests/settings.py, the same).
BUDGET = {"cents": 50_000}


def price(reference, cents, *rest, **options):
    """The cost of a budgeted call: its ``cents``, as a charge's price would be.

    ``K2B_TEST_PRICE`` on this process changes the price after the enqueue
    priced the call (a price list updated before a worker got to it): an int
    is added, ``raise`` raises, ``exit`` raises ``SystemExit``, ``garbage`` returns
    no cost, ``other-unit`` charges a unit the budget does not name.
    """
    change = os.environ.get("K2B_TEST_PRICE", "0")
    if change == "raise":
        raise LookupError(f"no price for {reference}")
    if change == "exit":
        raise SystemExit(3)
    if change == "garbage":
        return f"{cents} cents"
    if change == "other-unit":
        return {"euros": cents}
    return {"cents": cents + int(change)}


@declared("external", effect_budget=BUDGET, cost=price)
def budgeted_charge(order, cents):
    """EXTERNAL, at most BUDGET a call: the provider must never see a call over it."""
    _call("task.budgeted_charge", payload={"order": order, "cents": cents})
    return {"charged": cents}


@declared("idempotent", RETRY, effect_budget=BUDGET, cost=price, takes_context=True)
def budgeted_flaky(context: TaskContext, key, cents, failures, crash=None):
    """IDEMPOTENT, retried, at most BUDGET a call: raises on its first ``failures``
    attempts. A call of 30,000 cents charged twice would be over the budget."""
    _call("task.budgeted_flaky", key, {"attempt": context.attempt, "cents": cents})
    crash_point({"crash": crash}, "task_budgeted")
    if context.attempt <= failures:
        raise ConnectionError(f"attempt {context.attempt} failed")
    return {"attempt": context.attempt}


@declared("pure")
def cancels(run_id=None):
    """PURE, but for what a test makes of it: cancels the run ``run_id`` names, if any
    (a run of this task whose end waits to commit with this one's). Ended at once, as a
    timeout ends a run: ``cancel_workflow_run`` would only ask it (#49)."""
    from k2b_workflows.control import cancel_run

    _call("task.cancels", payload={"run_id": run_id})
    if run_id is not None:
        cancel_run(run_id, "canceled while its end waited")
    return run_id


# -- options from settings (OPTIONS["tasks"], tests/settings.py): a reconcile, Retry(on=) --


class Declined(Exception):
    """A provider's final "no": not worth a retry."""


@task(takes_context=True)
def charge_reconciled(context: TaskContext, order, crash=None, answer=None):
    """EXTERNAL with a reconcile, both from ``OPTIONS["tasks"]``: a crash before or after
    the provider's call is settled by ``was_charged``, not by an operator."""
    crash_point({"crash": crash}, "task_reconciled_before")
    _call("task.charge_reconciled", effect_key(context), {"order": order})
    crash_point({"crash": crash}, "task_reconciled_after")
    return {"charged": order}


def was_charged(context: TaskContext, order, crash=None, answer=None):
    """``charge_reconciled``'s reconcile: looks the charge up by its effect key, as a
    provider's API would; ``answer`` makes it answer otherwise."""
    from k2b_workflows import failed, succeeded, unknown

    _call("task.was_charged", effect_key(context), {"order": order})
    if answer == "unknown":
        return unknown("the provider's lookup is down")
    if answer == "raise":
        raise RuntimeError("lookup failed")
    if answer == "nonsense":
        return {"charged": order}
    if answer == "declined":
        return failed("the provider declined it", retryable=False)
    charged = ProviderCall.objects.filter(
        action="task.charge_reconciled", effect_key=effect_key(context)
    ).first()
    if charged is None:
        return failed("no charge under this key", retryable=True)
    return succeeded({"charged": charged.payload["order"], "found": True})


@task()
def picky(key, raised):
    """Retried only for what ``OPTIONS["tasks"]`` says (``Retry(on=...)``)."""
    _call("task.picky", key)
    if ProviderCall.objects.filter(action="task.picky", effect_key=key).count() < 3:
        raise {"ConnectionError": ConnectionError, "Declined": Declined}[raised]("no")
    return "ok"
