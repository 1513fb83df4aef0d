"""The error codes the kernel writes to ``WorkflowRun.error_code``.

A code is what an operator, an alert or a host's own code matches on, so it
never changes once shipped: the string is the contract, the constant only
spares a typo. They sit at the bottom of the layers, beside the exceptions,
so that any module may name one; ``k2b_workflows.store`` re-exports them for
code written when they lived there.
"""

from __future__ import annotations

WORKFLOW_RETRY_EXHAUSTED = "WORKFLOW_RETRY_EXHAUSTED"
EFFECT_BUDGET_EXCEEDED = "EFFECT_BUDGET_EXCEEDED"
INVALID_ACTION_RESULT = "INVALID_ACTION_RESULT"
INVALID_STEP_INPUT = "INVALID_STEP_INPUT"
INVALID_WORKFLOW_OUTPUT = "INVALID_WORKFLOW_OUTPUT"
WORKFLOW_NONDETERMINISTIC = "WORKFLOW_NONDETERMINISTIC"
#: The workflow function itself raised (not a step): a bug that waits for a fix.
WORKFLOW_CODE_ERROR = "WORKFLOW_CODE_ERROR"
INTEGRITY_CHAIN_BROKEN = "INTEGRITY_CHAIN_BROKEN"
FORBIDDEN = "FORBIDDEN"
APPROVAL_REQUIRED = "APPROVAL_REQUIRED"
BACKUP_REQUIRED = "BACKUP_REQUIRED"
MAX_STEPS_EXCEEDED = "MAX_STEPS_EXCEEDED"
FAN_OUT_EXCEEDED = "FAN_OUT_EXCEEDED"
EFFECT_OUTCOME_UNKNOWN = "EFFECT_OUTCOME_UNKNOWN"
#: A holder's late result says the opposite of the reconcile or the operator's
#: decision that closed its call (``kernel/contradictions.py``, #47).
EFFECT_CONTRADICTED = "EFFECT_CONTRADICTED"
AI_TASK_FAILED = "AI_TASK_FAILED"
CANCELED = "CANCELED"
#: A run not ended within its workflow's ``timeout``: canceled (``worker/timeouts.py``).
WORKFLOW_TIMEOUT = "WORKFLOW_TIMEOUT"
#: A ``cancel_newest`` start found its key's slots all taken.
CONCURRENCY_LIMITED = "CONCURRENCY_LIMITED"
#: ``rate_limit_key()`` raised or returned something that is not a key.
INVALID_RATE_LIMIT_KEY = "INVALID_RATE_LIMIT_KEY"
ACTION_FAILED = "ACTION_FAILED"

# django.tasks (#37): a task run's own codes.
#: The task function raised (or returned a value that is not JSON): the task FAILED.
TASK_FAILED = "TASK_FAILED"
#: The task's module no longer imports on the worker: nothing was called.
TASK_IMPORT_FAILED = "TASK_IMPORT_FAILED"
#: The module imports but holds no task at the enqueued path (renamed or removed).
TASK_NOT_FOUND = "TASK_NOT_FOUND"
#: The task's ``cost=`` raised, returned something that is not a cost, named a unit
#: its ``effect_budget`` does not, or does not import on the worker: nothing was
#: charged and the task was not called.
INVALID_TASK_COST = "INVALID_TASK_COST"
