"""docs/reference.md, "Public API": every name the page lists imports.

The imports are grouped by purpose, as the page shows them, not sorted.
"""
# ruff: noqa: F401, I001

# --8<-- [start:imports]
from k2b_workflows import (
    Action, Effect, workflow, StepContext,                       # define; ctx's type
    Concurrency, RateLimit, Unique, Fairness,                    # flow control
    succeeded, failed, waiting, ambiguous, unknown, Dependency,  # results
    start_workflow_run, cancel_workflow_run,                     # control
    wake_workflow_runs_waiting_on, notify_workflow_worker,
    create_child_workflow_runs, count_child_workflow_runs,
    resolve_effect, EFFECT_CONFIRMED, EFFECT_ABSENT, retry_workflow_run,
    fork_workflow_run, ForkRefused,                              # fork from a step
    pause_queue, resume_queue, paused_queues,                    # queues
    set_progress, progress_of, Progress,                         # progress
    dry_run, DryRunReport, ai_provider,
    Schedule, schedule_workflow,                                 # schedules
    wait_for_workflow_run, await_workflow_run,                   # results and async
    astart_workflow_run, acancel_workflow_run, awake_workflow_runs_waiting_on,
    Retry,                                                       # retry policies
    StepFailed, LeaseLost, RunCanceled, DatabaseNotMigrated,     # exceptions
    UnknownWorkflow, InvalidInput, IdempotencyConflict, ResolutionRefused, EvidenceChanged,
    NotRetryable, InvalidSchedule, RunEndNotSealed,
)
from k2b_workflows.store import (
    WORKFLOW_RUN_LEASE_MS, WORKFLOW_RUN_MAX_CONSECUTIVE_FAILURES, WORKFLOW_RETRY_EXHAUSTED,
)
from k2b_workflows.testing import run_until_idle
from k2b_workflows.dedup import insert_once, DedupConflict
from k2b_workflows.models import WorkflowRun, JournalEntry, LedgerEntry, DedupRecord
from k2b_workflows.models import WorkflowSchedule, QueuePause
from k2b_workflows.signals import run_needs_attention, run_finished   # sent after commit
# --8<-- [end:imports]
