"""Where the settings' readers and the historical constants were, and stay importable.

``k2b_workflows.settings`` declares every key of ``K2B_WORKFLOWS`` once, with
its default and its reader; these names are aliases of those. The
``WORKFLOW_*`` constants (``WORKFLOW_RUN_LEASE_MS``,
``WORKFLOW_RUN_MAX_CONSECUTIVE_FAILURES``...) are the declared defaults, and
the error codes (``WORKFLOW_RETRY_EXHAUSTED``...) are ``codes``'s: both are
part of the public API.

For users only: the package itself reads ``settings`` and ``codes``, and an
import-linter contract (pyproject.toml) fails the build for a module of it
that imports this one. Two homes had drifted once: a setting was readable from
``settings`` and not from here.
"""

from __future__ import annotations

from . import codes
from .settings import (  # noqa: F401  (the readers, importable from here as before)
    CHANNEL,
    DEFAULT_REDACT_EXACT_KEYS,
    DEFAULT_REDACT_KEYS,
    action_timeout_ms,
    admin_run_page_rows,
    ai_task_max_attempts,
    backoff_ms,
    claim_prefetch,
    database,
    default,
    error_text_max_chars,
    evidence_key_secrets,
    known_settings,
    lease_ms,
    listen_database,
    max_children_per_step,
    max_consecutive_failures,
    max_reconcile_polls,
    max_value_bytes,
    owner_database,
    poll_interval_ms,
    priority_aging_ms,
    rate_limit_margin_ms,
    redact_exact_keys,
    redact_hook,
    redact_keys,
    retry_backoff_max_ms,
    retry_backoff_ms,
    schedule_max_catch_up,
    schedule_missed_after,
    schedule_missed_after_ms,
    schedule_pass_interval_ms,
    shutdown_grace_ms,
    wake_retention_hours,
    witness_sink,
    worker_fresh_ms,
    worker_heartbeat_ms,
    worker_lost_after_ms,
    worker_purge_after_ms,
)

#: Default lease of a claimed run, in milliseconds.
WORKFLOW_RUN_LEASE_MS: int = default("RUN_LEASE_MS")
#: Default number of consecutive failures (retryable failures or crashes) tolerated.
WORKFLOW_RUN_MAX_CONSECUTIVE_FAILURES: int = default("RUN_MAX_CONSECUTIVE_FAILURES")
WORKFLOW_RETRY_BACKOFF_MS: int = default("RETRY_BACKOFF_MS")
WORKFLOW_RETRY_BACKOFF_MAX_MS: int = default("RETRY_BACKOFF_MAX_MS")
WORKFLOW_POLL_INTERVAL_MS: int = default("POLL_INTERVAL_MS")
WORKFLOW_MAX_CHILDREN_PER_STEP: int = default("MAX_CHILDREN_PER_STEP")
WORKFLOW_ACTION_TIMEOUT_MS: int = default("ACTION_TIMEOUT_MS")
WORKFLOW_CLAIM_PREFETCH: int = default("CLAIM_PREFETCH")
WORKFLOW_SHUTDOWN_GRACE_MS: int = default("SHUTDOWN_GRACE_MS")
WORKFLOW_MAX_VALUE_BYTES: int = default("MAX_VALUE_BYTES")
WORKFLOW_AI_TASK_MAX_ATTEMPTS: int = default("AI_TASK_MAX_ATTEMPTS")
WORKFLOW_MAX_RECONCILE_POLLS: int = default("MAX_RECONCILE_POLLS")
WORKFLOW_WAKE_RETENTION_HOURS: int = default("WAKE_RETENTION_HOURS")
WORKFLOW_WORKER_PURGE_AFTER_MS: int = default("WORKER_PURGE_AFTER_MS")
WORKFLOW_PRIORITY_AGING_MS: int = default("PRIORITY_AGING_MS")
WORKFLOW_RATE_LIMIT_MARGIN_MS: int = default("RATE_LIMIT_MARGIN_MS")
SCHEDULE_MAX_CATCH_UP: int = default("SCHEDULE_MAX_CATCH_UP")
SCHEDULE_MISSED_AFTER_MS: int = default("SCHEDULE_MISSED_AFTER_MS")
SCHEDULE_PASS_INTERVAL_MS: int = default("SCHEDULE_PASS_INTERVAL_MS")

# The error codes live in ``codes.py``; the names stay importable from here.
WORKFLOW_RETRY_EXHAUSTED = codes.WORKFLOW_RETRY_EXHAUSTED
EFFECT_BUDGET_EXCEEDED = codes.EFFECT_BUDGET_EXCEEDED
INVALID_ACTION_RESULT = codes.INVALID_ACTION_RESULT
INVALID_STEP_INPUT = codes.INVALID_STEP_INPUT
INVALID_WORKFLOW_OUTPUT = codes.INVALID_WORKFLOW_OUTPUT
WORKFLOW_NONDETERMINISTIC = codes.WORKFLOW_NONDETERMINISTIC
WORKFLOW_CODE_ERROR = codes.WORKFLOW_CODE_ERROR
INTEGRITY_CHAIN_BROKEN = codes.INTEGRITY_CHAIN_BROKEN
FORBIDDEN = codes.FORBIDDEN
APPROVAL_REQUIRED = codes.APPROVAL_REQUIRED
BACKUP_REQUIRED = codes.BACKUP_REQUIRED
MAX_STEPS_EXCEEDED = codes.MAX_STEPS_EXCEEDED
FAN_OUT_EXCEEDED = codes.FAN_OUT_EXCEEDED
EFFECT_OUTCOME_UNKNOWN = codes.EFFECT_OUTCOME_UNKNOWN
AI_TASK_FAILED = codes.AI_TASK_FAILED
CANCELED = codes.CANCELED
WORKFLOW_TIMEOUT = codes.WORKFLOW_TIMEOUT
CONCURRENCY_LIMITED = codes.CONCURRENCY_LIMITED
INVALID_RATE_LIMIT_KEY = codes.INVALID_RATE_LIMIT_KEY
ACTION_FAILED = codes.ACTION_FAILED
