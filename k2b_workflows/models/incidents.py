"""The incident queue: the runs that need an operator, as an admin entry of their own."""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import models

from .journal import LedgerEntry
from .runs import RunStatus, WorkflowRun


class IncidentManager(models.Manager["Incident"]):
    def get_queryset(self) -> models.QuerySet[Incident]:
        return super().get_queryset().filter(status=RunStatus.NEEDS_ATTENTION)


class Incident(WorkflowRun):
    """A run in ``needs_attention``: the admin's incident queue, oldest first.

    A proxy (no table of its own) so that the queue is its own admin entry
    with its own changelist, next to the list of all runs.
    """

    objects: ClassVar[IncidentManager] = IncidentManager()

    #: The ledger entries of the step in doubt, prefetched by the incident queue's
    #: admin (``to_attr``): an annotation only, no field.
    entries: list[LedgerEntry]
    #: The run's input if it is small, else None: an annotation of the queue's admin.
    call_input: Any

    class Meta:
        proxy = True
        ordering = ["updated_at", "created_at"]
