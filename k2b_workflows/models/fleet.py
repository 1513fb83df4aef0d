"""The fleet's rows: one per ``runworkflows`` process, as it last reported itself.

An operator needs to see which workers are alive without asking each one;
a process that died says nothing, so its row is what tells (a heartbeat too
old).
"""

from __future__ import annotations

from django.db import models


class WorkerRecord(models.Model):
    """One ``runworkflows`` process, as it last reported itself: the fleet an operator sees.

    Written only by the worker's heartbeat thread (on a connection of its own,
    so a worker busy with long steps still beats) and by whoever notices a
    heartbeat too old and marks the row lost. Runs name their worker in
    ``WorkflowRun.claimed_by``, which is ``worker_id``. Not a foreign key: a
    run must never wait on, or be deleted with, the row of a dead process.
    """

    class State(models.TextChoices):
        ALIVE = "alive"
        STOPPED = "stopped"
        LOST = "lost"

    worker_id = models.CharField(max_length=200, primary_key=True)
    host = models.CharField(max_length=255)
    pid = models.IntegerField()
    started_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField()
    stopped_at = models.DateTimeField(null=True, blank=True)
    state = models.CharField(max_length=10, choices=State.choices, default=State.ALIVE)
    concurrency = models.PositiveIntegerField()
    #: The ``--app`` filter; empty: every app.
    apps = models.JSONField(default=list, blank=True)
    #: What it can claim: ``[{"name": ..., "version": ..., "app_id": ...}, ...]``.
    workflows = models.JSONField(default=list, blank=True)
    in_flight = models.PositiveIntegerField(default=0)

    class Meta:
        db_table = "k2b_worker"
        ordering = ["state", "-heartbeat_at"]
        verbose_name = "worker"
        indexes = [models.Index(fields=["state", "heartbeat_at"], name="k2b_worker_state_beat")]

    def __str__(self) -> str:
        return self.worker_id
