"""The operators' admin: runs, incidents, schedules, workers and the overview.

No user code imports this package: Django's admin autodiscovery does, and
importing it registers the model admins (``runs`` for runs, incidents,
journal, ledger and workers; ``schedules`` for the Schedules page). The
views, what the run page draws and the overview's queries are imported on
first use (``runs`` reaches them lazily), so a worker process that imports
the admin through ``django.setup()`` pays for none of them.
"""

from __future__ import annotations

from . import runs, schedules
from .runs import (
    IncidentAdmin,
    JournalEntryAdmin,
    LedgerEntryAdmin,
    WorkerRecordAdmin,
    WorkflowRunAdmin,
)
from .schedules import WorkflowScheduleAdmin

__all__ = [
    "IncidentAdmin",
    "JournalEntryAdmin",
    "LedgerEntryAdmin",
    "WorkerRecordAdmin",
    "WorkflowRunAdmin",
    "WorkflowScheduleAdmin",
    "runs",
    "schedules",
]
