"""Tasks declared with Django's proposed options: ``max_attempts``, ``backoff``, ``timeout``
(django/new-features #142, #144; #49).

Each records its calls in ``ProviderCall`` (committed at once), so a test counts
them. Django 6.1 and the backport take the options on ``@task``; on Django 6.0
``TIMED`` gives the same through the default backend's ``OPTIONS["tasks"]``
(tests/settings.py).
"""

from __future__ import annotations

import asyncio
import os
import time

from tests.models import ProviderCall
from tests.tasks_app.tasks import EXTRA_ARGUMENTS, task
from tests.tasks_app.timed_options import SLOW_S, TIMED


def _call(action: str, key: str = "", payload=None) -> None:
    ProviderCall.objects.create(action=action, effect_key=key, pid=os.getpid(), payload=payload)


def timed(name: str, **django_options):
    """``@task(**TIMED[name])``, or on Django 6.0 a bare ``@task`` that settings declare."""
    if EXTRA_ARGUMENTS:
        return task(**TIMED[name], **django_options)
    return task(**django_options)


@timed("bounded")
def bounded(key):
    _call("timed.bounded", key)
    raise ConnectionError("the provider is down")


@timed("stops")
def stops(key):
    _call("timed.stops", key)
    raise ConnectionError("the provider is down")


@timed("spaced")
def spaced(key):
    _call("timed.spaced", key)
    raise ConnectionError("the provider is down")


@timed("asked")
def asked(key):
    _call("timed.asked", key)
    raise ConnectionError("the provider is down")


@timed("buggy_backoff")
def buggy_backoff(key):
    _call("timed.buggy_backoff", key)
    raise ConnectionError("the provider is down")


@timed("slow_once", takes_context=True)
def slow_once(context, key):
    """Runs past its timeout on its first attempt only, then returns at once."""
    _call("timed.slow_once", key, {"attempt": context.attempt})
    if context.attempt == 1:
        time.sleep(SLOW_S)
    return context.attempt


@timed("always_slow")
def always_slow(key):
    _call("timed.always_slow", key)
    time.sleep(SLOW_S)
    return "late"


@timed("slow_async")
async def slow_async(key):
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        # Written from the loop's thread: the call learns it was cut, at its await.
        await asyncio.to_thread(_call, "timed.slow_async.cancelled", key)
        raise
    return "never"


@timed("slow_external")
def slow_external(key):
    _call("timed.slow_external", key)
    time.sleep(SLOW_S)
    return "charged, but late"
