"""Tasks the batch tests enqueue (#50): members that succeed, fail or crash, and
callbacks that record each call in ``ProviderCall`` with the batch's id as key.

``K2B_TEST_CRASH=batch_callback`` kills a worker inside a callback, after it
recorded its call; ``crash="batch_member"`` with ``K2B_TEST_CRASH=batch_member``
kills it inside an external member (which then needs an operator).
"""

from __future__ import annotations

import os
import signal
import time

from tests.models import ProviderCall
from tests.tasks_app.tasks import declared
from tests.workflows import crash_point


def _record(action: str, batch_id: str) -> None:
    ProviderCall.objects.create(action=action, effect_key=batch_id, pid=os.getpid())
    if os.environ.get("K2B_TEST_CRASH") == "batch_callback":
        os.kill(os.getpid(), signal.SIGKILL)


@declared("pure")
def member(n, fail=False, seconds=0):
    time.sleep(seconds)
    if fail:
        raise ValueError(f"member {n} fails")
    return n


@declared("external")
def external_member(n, crash=None):
    crash_point({"crash": crash}, "batch_member")
    return n


@declared("idempotent")
def on_finish(batch_id):
    _record("batch.on_finish", batch_id)


@declared("idempotent")
def on_success(batch_id):
    _record("batch.on_success", batch_id)


@declared("idempotent")
def on_failure(batch_id):
    _record("batch.on_failure", batch_id)


@declared("pure")
def takes_no_batch_id(other):
    return other
