"""The app's models, one module per thing they hold; every name importable from here.

Django imports this package for the app's models. The run and the rows that
hang on its steps are in ``runs``; the models about one thing each live in a
module of their own: ``schedules``, ``budgets``, ``ai`` (AI tasks),
``batches``, ``fleet`` (the workers), ``flow`` (rate limits), ``overview``
(the admin's per-minute counts), ``progress`` and ``queues`` (paused queues).
They are models of this app all the same (app label ``k2b_workflows``, the
same tables), and ``from k2b_workflows.models import WorkflowRun`` works as it
did when they were one module.
"""

# isort: off
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
    DedupRecord,
    Incident,
    IncidentManager,
    JournalEntry,
    LedgerEntry,
    QueueOrder,
    RunStatus,
    TaskAttempt,
    WaitRendezvous,
    WorkflowRun,
)
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
