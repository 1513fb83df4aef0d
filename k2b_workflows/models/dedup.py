"""The dedup rows of idempotent actions whose provider does not deduplicate."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from .runs import WorkflowRun


class DedupRecord(models.Model):
    """A dedup table for idempotent actions whose provider does not deduplicate.

    Two unique constraints on purpose (``key`` and ``(run, step, name)``):
    write it with ``k2b_workflows.dedup.insert_once``, never ``get_or_create``.
    """

    key = models.CharField(max_length=255, unique=True)
    run = models.ForeignKey(
        WorkflowRun, null=True, blank=True, on_delete=models.PROTECT, related_name="dedup_records"
    )
    step = models.IntegerField(null=True, blank=True)
    name = models.CharField(max_length=200, blank=True, default="")
    value = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "k2b_dedup"
        constraints = [
            models.UniqueConstraint(fields=["run", "step", "name"], name="k2b_dedup_run_step_name")
        ]

    def __str__(self) -> str:
        return self.key
