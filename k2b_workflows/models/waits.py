"""The rendezvous row that a parked run and its wake both lock, so that no wake is lost."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class WaitRendezvous(models.Model):
    """The one row per ``(app_id, kind, key)`` that parking and waking both lock.

    ``signal_seq`` counts wakes; a run remembers the last one it has seen, so a
    wake that commits before the waiter parks is never lost.
    """

    app_id = models.CharField(max_length=100)
    kind = models.CharField(max_length=200)
    key = models.CharField(max_length=500)
    signal_seq = models.BigIntegerField(default=0)
    signaled_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "k2b_wait"
        verbose_name_plural = "wait rendezvous"
        constraints = [
            models.UniqueConstraint(fields=["app_id", "kind", "key"], name="k2b_wait_occurrence")
        ]

    def __str__(self) -> str:
        return f"{self.app_id}/{self.kind}/{self.key}"
