"""Actions and workflows for the durable-wait tests (imported by ``tests/workflows/__init__.py``).

``waits.gate`` waits until a ``DomainRow`` with its key exists: whoever
creates that row wakes ``("tests", "gate", key)`` in the same transaction.
``waits.poll`` is provider polling: a pending answer is checked again when
the wait's deadline passes, always with the same ``effect_key``.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import sys
import time

from django.db import transaction

from k2b_workflows import (
    Action,
    Dependency,
    Effect,
    succeeded,
    waiting,
    wake_workflow_runs_waiting_on,
)
from tests.models import DomainRow, ProviderCall
from tests.support.workflow_steps import one_step

GATE_KIND = "gate"


class Gate(Action):
    """Succeeds with the gate row's value once it exists; until then waits on it.

    Input: ``key``; ``quiet`` (do not log each call, for the stress test);
    ``hold`` (after reading, block until a row with that key exists, so a
    test can commit the wake between this read and the park); ``jitter_ms``
    (sleep up to that long after reading, to widen that window in races).
    """

    name = "waits.gate"
    effect = Effect.PURE

    def run(self, ctx, input):
        row = DomainRow.objects.filter(key=input["key"]).first()
        if not input.get("quiet"):
            ProviderCall.objects.create(
                action=self.name,
                effect_key=ctx.effect_key,
                generation=ctx.generation,
                pid=os.getpid(),
            )
        if row is not None:
            return succeeded({"value": row.value})
        if input.get("jitter_ms"):
            # Widen the window between "not ready" and the park for the race.
            time.sleep(random.uniform(0, input["jitter_ms"]) / 1000)
        hold = input.get("hold")
        if hold:
            give_up = time.monotonic() + 30
            while not DomainRow.objects.filter(key=hold).exists() and time.monotonic() < give_up:
                time.sleep(0.02)
        deadline = input.get("deadline_s")
        return waiting(
            Dependency(
                GATE_KIND,
                input["key"],
                deadline=dt.timedelta(seconds=deadline) if deadline else None,
            )
        )


class PollProvider(Action):
    """IDEMPOTENT provider polling: each call asks the provider again under the same key.

    The simulated provider answers "pending" until it has been asked
    ``ready_after`` times for this ``effect_key``; each pending answer waits
    on a deadline ``every_s`` seconds away.
    """

    name = "waits.poll_provider"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True}, summary="poll the provider")

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name, effect_key=ctx.effect_key, generation=ctx.generation, pid=os.getpid()
        )
        asked = ProviderCall.objects.filter(action=self.name, effect_key=ctx.effect_key).count()
        if asked < input["ready_after"]:
            return waiting(
                Dependency(
                    "provider", ctx.effect_key, deadline=dt.timedelta(seconds=input["every_s"])
                )
            )
        return succeeded({"polls": asked})


one_step("waits.gate", Gate)


one_step("waits.poll", PollProvider)


def open_gate(key: str, value: object = None) -> int:
    """Create the gate row and wake its waiters in one transaction (returns runs re-queued)."""
    with transaction.atomic():
        DomainRow.objects.create(key=key, value=value)
        return wake_workflow_runs_waiting_on(app_id="tests", kind=GATE_KIND, key=key)


#: A run of the stress test with this ``wake`` input is woken only once it has parked.
WAKE_AFTER_PARK = "after_park"


def waker_main(argv: list[str]) -> None:
    """A waker process for the stress test: wake runs of its share as soon as they start.

    ``argv``: prefix, total, share, shares. It opens the gate of every run
    whose key is ``{prefix}{i}`` with ``i % shares == share``, as soon as the
    run has been claimed at least once, so wakes race the runs' parks; a run
    whose input has ``"wake": WAKE_AFTER_PARK`` only once it is ``waiting``.
    Prints how many wakes re-queued a parked run and how many found none parked.
    """
    prefix, total, share, shares = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    from django.db import connection

    pending = {f"{prefix}{i}" for i in range(total) if i % shares == share}
    parked = unparked = 0
    give_up = time.monotonic() + 600
    while pending and time.monotonic() < give_up:
        with connection.cursor() as cursor:
            cursor.execute(
                """SELECT input->>'key' FROM k2b_run
                    WHERE workflow_name = 'waits.gate' AND generation >= 1
                      AND input->>'key' = ANY(%s)
                      AND (input->>'wake' IS DISTINCT FROM %s OR status = 'waiting')""",
                [list(pending), WAKE_AFTER_PARK],
            )
            started = [row[0] for row in cursor.fetchall()]
        if not started:
            time.sleep(0.005)
            continue
        for key in started:
            if open_gate(key, key):
                parked += 1
            else:
                unparked += 1
            pending.discard(key)
    sys.stdout.write(f"parked={parked} unparked={unparked} left={len(pending)}\n")
