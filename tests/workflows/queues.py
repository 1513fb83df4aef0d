"""Workflows on named queues, for the pause and resume tests (#49).

``queues.held`` runs in the queue "held": its step commits a ``ProviderCall``
as it starts, then holds until the test commits the ``DomainRow`` its input
names (at most 30 s), so a test can pause the queue while the run is claimed.
``queues.note`` commits one ``ProviderCall`` and ends; a start may put it in
any queue.
"""

from __future__ import annotations

import os
import time

from k2b_workflows import Action, Effect, succeeded
from tests.models import DomainRow, ProviderCall
from tests.support.workflow_steps import one_step


class Note(Action):
    """PURE: commits a row naming the run's input, then holds while asked to."""

    name = "queues.note"
    effect = Effect.PURE

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name, effect_key=ctx.effect_key, pid=os.getpid(), payload=input
        )
        hold = input.get("hold")
        give_up = time.monotonic() + 30
        while hold and not DomainRow.objects.filter(key=hold).exists():
            if time.monotonic() > give_up:
                raise RuntimeError(f"{hold} was never released")
            time.sleep(0.02)
        return succeeded({"noted": input.get("n")})


one_step("queues.held", Note, queue="held")
one_step("queues.note", Note)
