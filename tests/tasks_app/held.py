"""Tasks that stay inside their call until the test lets them go (#51).

Each says it started with a ``ProviderCall`` row (``held.started``, its key), then
waits for a row the test writes (``held.release``, the same key): a test cancels
the run in between, with the call certainly in flight and no sleep to guess at.
"""

from __future__ import annotations

import asyncio
import time

from asgiref.sync import sync_to_async

from k2b_workflows import Retry
from k2b_workflows.tasks import is_cancel_requested
from tests.models import ProviderCall
from tests.tasks_app.tasks import _call, declared

#: A call never released (a test that failed before releasing it) gives up after this
#: long, so that a stuck worker does not outlive its test by much.
PATIENCE = 120.0


def hold(key: str) -> None:
    """Say the call started, then wait until the test releases ``key``."""
    _call("held.started", key)
    deadline = time.monotonic() + PATIENCE
    while not ProviderCall.objects.filter(action="held.release", effect_key=key).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"held call {key!r} was never released")
        time.sleep(0.02)


def release(key: str) -> None:
    """Let the call held on ``key`` return."""
    _call("held.release", key)


@declared("pure")
def held(key):
    """PURE: returns once released."""
    hold(key)
    return {"held": key}


@declared("external")
def held_charge(key):
    """EXTERNAL: the provider sees the charge, then the call returns once released."""
    hold(key)
    _call("held.charged", key)
    return {"charged": key}


def released(key: str) -> bool:
    return ProviderCall.objects.filter(action="held.release", effect_key=key).exists()


@declared("pure", takes_context=True)
def polling(context, key):
    """PURE: works until asked to stop (#49), says when it saw the request, returns."""
    _call("held.started", key)
    deadline = time.monotonic() + PATIENCE
    while not is_cancel_requested(context):
        if time.monotonic() > deadline:
            raise TimeoutError(f"call {key!r} was never asked to stop")
        time.sleep(0.01)
    _call("held.asked", key, payload={"at": time.time()})
    return {"stopped": key}


@declared("pure", retry=Retry(max_attempts=3, backoff=0.01, jitter=False))
def held_then_raises(key):
    """PURE, retried under its policy: raises once released."""
    hold(key)
    raise ValueError(f"raised once released: {key}")


@declared("pure")
def held_then_fails(key):
    """PURE, not retried: raises once released."""
    hold(key)
    raise ValueError(f"raised once released: {key}")


@declared("pure")
async def held_async(key):
    """PURE and async: awaits until released; says when it is cancelled, and lets it through."""
    await sync_to_async(_call)("held.started", key)
    deadline = time.monotonic() + PATIENCE
    try:
        while not await sync_to_async(released)(key):
            if time.monotonic() > deadline:
                raise TimeoutError(f"held call {key!r} was never released")
            await asyncio.sleep(0.02)
    except asyncio.CancelledError:
        await sync_to_async(_call)("held.cancelled", key)
        raise
    return {"held": key}


@declared("external", takes_context=True)
async def held_charge_async(context, key):
    """EXTERNAL and async: says when it saw the cancel request, keeps on until released."""
    await sync_to_async(_call)("held.started", key)
    deadline = time.monotonic() + PATIENCE
    said = False
    try:
        while not await sync_to_async(released)(key):
            if time.monotonic() > deadline:
                raise TimeoutError(f"held call {key!r} was never released")
            if not said and await sync_to_async(is_cancel_requested)(context):
                await sync_to_async(_call)("held.asked", key)
                said = True
            await asyncio.sleep(0.02)
    except asyncio.CancelledError:
        await sync_to_async(_call)("held.cancelled", key)
        raise
    await sync_to_async(_call)("held.charged", key)
    return {"charged": key}
