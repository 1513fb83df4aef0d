"""Tasks that stay inside their call until the test lets them go (#51).

Each says it started with a ``ProviderCall`` row (``held.started``, its key), then
waits for a row the test writes (``held.release``, the same key): a test cancels
the run in between, with the call certainly in flight and no sleep to guess at.
"""

from __future__ import annotations

import time

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
