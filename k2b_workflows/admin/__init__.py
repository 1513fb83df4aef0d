"""The operators' admin: runs, incidents, schedules, workers and the overview.

No user code imports this package: Django's admin autodiscovery does, and
importing it registers the model admins (``runs`` for runs and incidents,
``entries`` for the journal and the ledger, ``workers`` for the fleet,
``schedules`` for the Schedules page, ``queues`` for the Queues page,
``batches`` for task batches). The views, what the run page draws and the
overview's queries are imported on first use (``runs`` reaches them lazily),
so a worker process that imports the admin through ``django.setup()`` pays for none of them.
"""

from __future__ import annotations

from . import batches, entries, queues, runs, schedules, workers
from .batches import TaskBatchAdmin
from .entries import JournalEntryAdmin, LedgerEntryAdmin
from .queues import QueuesAdmin
from .runs import IncidentAdmin, WorkflowRunAdmin
from .schedules import WorkflowScheduleAdmin
from .workers import WorkerRecordAdmin

__all__ = [
    "IncidentAdmin",
    "JournalEntryAdmin",
    "LedgerEntryAdmin",
    "QueuesAdmin",
    "TaskBatchAdmin",
    "WorkerRecordAdmin",
    "WorkflowRunAdmin",
    "WorkflowScheduleAdmin",
    "batches",
    "entries",
    "queues",
    "runs",
    "schedules",
    "workers",
]
