"""A paused queue's row: what every worker reads before it claims (#49).

The failure this row is built around: a pause held in a process's memory or
in one node's settings. Elsewhere one node's pause stalled a whole new deploy,
and deploys silently unpaused queues. A row is seen by every worker of every
release at its next claim, and outlives restarts and deploys; it is deleted
by a resume, and by nothing else.
"""

from __future__ import annotations

from django.db import models


class QueuePause(models.Model):
    """A queue no worker claims from until it is resumed: who paused it, when and why.

    Written only by ``kernel/pauses.py`` (``pause_queue``, ``resume_queue``, the
    admin's Queues page and ``workflowqueues`` all call it). Not a foreign key
    to anything: a queue is a name that runs carry, and a queue may be paused
    before its first run is enqueued.
    """

    queue = models.CharField(max_length=100, primary_key=True)
    reason = models.TextField()
    #: The operator's user name, or the label code passed as ``actor``; "" if none.
    paused_by = models.CharField(max_length=150, blank=True, default="")
    paused_at = models.DateTimeField()

    class Meta:
        db_table = "k2b_queue_pause"
        ordering = ["queue"]
        verbose_name = "queue"
        verbose_name_plural = "queues"
        permissions = [("pause_queue", "Can pause and resume a queue")]

    def __str__(self) -> str:
        return self.queue
