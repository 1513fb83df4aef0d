"""The app's models, a module for each thing their rows hold; every name importable from here.

Django imports this package for the app's models. ``runs`` holds a run, its
statuses and lifecycle; the rows that hang on a run's steps are ``journal``
(the journal and the evidence ledger), ``waits``, ``dedup``, ``attempts`` (a
task's failed attempts) and ``incidents`` (the admin's queue of runs that need
an operator, a proxy). The models about one thing each: ``schedules``,
``budgets``, ``ai`` (AI tasks), ``batches``, ``fleet`` (the workers),
``flow`` (rate limits), ``overview`` (the admin's per-minute counts),
``progress`` and ``queues`` (paused queues). They are models of this app all
the same (app label ``k2b_workflows``, the same tables), and
``from k2b_workflows.models import WorkflowRun`` works as it did when they
were one module.
"""

# isort: off
# Importing pgtrigger's app module lets models declare ``Meta.triggers``. It is
# imported by Django only when 'pgtrigger' is in INSTALLED_APPS; without this
# line, forgetting it fails the first module with triggers with "'class Meta'
# got invalid attribute(s): triggers" before the system check (E003) can say
# what is wrong. Every module of the package is imported after this one.
import pgtrigger.apps  # noqa: F401

# Django registers the models in the order their classes are made: the run
# first, then the rest in the order they were declared when they were one
# module, so the app's list of models (apps.get_models()) is unchanged.
from .runs import (
    ENDED_CHANNEL,
    FINAL_STATUSES,
    RUN_TRANSITIONS,
    SETTLED_STATUSES,
    TERMINAL_STATUSES,
    UNIQUE_HELD,
    QueueOrder,
    RunStatus,
    WorkflowRun,
)
from .journal import JournalEntry, LedgerEntry
from .waits import WaitRendezvous
from .dedup import DedupRecord
from .attempts import TaskAttempt
from .incidents import Incident, IncidentManager
from .ai import AiTask
from .batches import TaskBatch
from .budgets import BudgetAccount, BudgetCharge
from .fleet import WorkerRecord
from .flow import RateDispatch
from .overview import OverviewMinute
from .progress import RunProgress
from .queues import QueuePause
from .schedules import WorkflowSchedule, WorkflowScheduleSkip

# isort: on

__all__ = [
    "ENDED_CHANNEL",
    "FINAL_STATUSES",
    "RUN_TRANSITIONS",
    "SETTLED_STATUSES",
    "TERMINAL_STATUSES",
    "UNIQUE_HELD",
    "AiTask",
    "BudgetAccount",
    "BudgetCharge",
    "DedupRecord",
    "Incident",
    "IncidentManager",
    "JournalEntry",
    "LedgerEntry",
    "OverviewMinute",
    "QueueOrder",
    "QueuePause",
    "RateDispatch",
    "RunProgress",
    "RunStatus",
    "TaskAttempt",
    "TaskBatch",
    "WaitRendezvous",
    "WorkerRecord",
    "WorkflowRun",
    "WorkflowSchedule",
    "WorkflowScheduleSkip",
]
