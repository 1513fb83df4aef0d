"""Paused queues: no worker claims a paused queue's runs, wherever and whenever it runs (#49).

The failure this is built around: a pause that lives in a process. Held in
memory or in one node's settings, it is lost by a restart or a deploy, or
holds on one node and not the next. Here a pause is a row of
``k2b_queue_pause``, and the claim statement itself reads it
(``flow.NOT_PAUSED``): every worker of every release honours it from its next
claim, with no round trip of its own. PostgreSQL reads the table once per
statement (a hashed subplan), so the claim stays the same walk of the
queued runs' index.

A run already claimed is not taken back: it finishes. Enqueues and schedule
ticks into a paused queue are accepted and queued. The places that decide
whether runnable work exists (a burst worker's ``pending``, ``run_until_idle``,
the loop's next wake-up) read the same condition, so a paused queue's due runs
neither keep a worker spinning nor stop a burst worker from ending.

A resume deletes the row and notifies every worker, of every app, in the same
transaction: idle workers claim at once instead of at their next poll.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import connections, transaction

from ..models import QueuePause
from . import waits

logger = logging.getLogger("k2b_workflows")

_PAUSE_SQL = """
INSERT INTO k2b_queue_pause (queue, reason, paused_by, paused_at)
VALUES (%s, %s, %s, k2b_now())
    ON CONFLICT (queue) DO NOTHING
RETURNING queue, reason, paused_by, paused_at
"""

_RESUME_SQL = """
DELETE FROM k2b_queue_pause WHERE queue = %s
RETURNING queue, reason, paused_by, paused_at
"""


def _row(values: Any) -> QueuePause:
    queue, reason, paused_by, paused_at = values
    return QueuePause(queue=queue, reason=reason, paused_by=paused_by, paused_at=paused_at)


def pause(using: str, queue: str, *, reason: str, paused_by: str) -> QueuePause | None:
    """Pause ``queue``; None if it was paused already (the first pause's row is kept).

    The first pause's reason stays: a second operator pausing a queue during an
    incident must not overwrite why the first one did.
    """
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        cursor.execute(_PAUSE_SQL, [queue, reason, paused_by])
        row = cursor.fetchone()
    if row is None:
        return None
    logger.warning("queue %r paused by %s: %s", queue, paused_by or "(unnamed)", reason)
    return _row(row)


def resume(using: str, queue: str, *, resumed_by: str) -> QueuePause | None:
    """Resume ``queue`` and wake every worker; the pause's row, or None if it was not paused."""
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        cursor.execute(_RESUME_SQL, [queue])
        row = cursor.fetchone()
        if row is None:
            return None
        # Delivered at the commit, to workers of every app: a queue is not an app's.
        waits.notify(using, waits.EVERY_APP)
    logger.warning("queue %r resumed by %s", queue, resumed_by or "(unnamed)")
    return _row(row)


def paused(using: str) -> dict[str, QueuePause]:
    """Every paused queue's row, by queue name."""
    return {row.queue: row for row in QueuePause.objects.using(using).order_by("queue")}
