"""AI tasks: durable calls to an AI provider, one row per step, run by any worker.

A provider call can take minutes and fail half-way; a row per call, with its
own lease and generation, lets another worker take it over and a trigger
keep its status to the lifecycle below, whatever a buggy worker writes.
"""

from __future__ import annotations

import uuid

import pgtrigger
from django.db import models
from django.utils import timezone

from ..triggers import GuardedFSM, Notify


class AiTask(models.Model):
    """A durable call to an AI provider, created once per step and run by workers."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        CANCELED = "canceled"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    run = models.ForeignKey(
        "k2b_workflows.WorkflowRun", on_delete=models.PROTECT, related_name="ai_tasks"
    )
    seq = models.IntegerField()
    app_id = models.CharField(max_length=100)
    effect_key = models.CharField(max_length=200, unique=True)
    provider = models.CharField(max_length=200)
    request = models.JSONField()
    #: HMAC under the evidence key over the request and whose it is (``kernel/ai.py``):
    #: a worker calls the provider only with a request the kernel wrote.
    request_seal = models.CharField(max_length=100, blank=True, default="", editable=False)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.QUEUED)
    result = models.JSONField(null=True, blank=True)
    error_message = models.TextField(blank=True, default="")
    attempts = models.IntegerField(default=0)
    generation = models.BigIntegerField(default=0)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "k2b_ai_task"
        verbose_name = "AI task"
        indexes = [
            models.Index(
                fields=["created_at"], condition=models.Q(status="queued"), name="k2b_ai_queued"
            ),
        ]
        triggers = [
            GuardedFSM(
                name="ai_status_transitions",
                field="status",
                transitions=[
                    ("queued", "running"),
                    ("queued", "canceled"),
                    ("running", "queued"),
                    ("running", "succeeded"),
                    ("running", "failed"),
                    ("running", "canceled"),
                ],
            ),
            Notify(
                name="notify_ai_queued",
                operation=pgtrigger.Insert | pgtrigger.Update,
                condition=pgtrigger.Q(new__status="queued"),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.provider} for {self.run_id} #{self.seq}"
