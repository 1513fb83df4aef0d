"""Settings access: every key of ``K2B_WORKFLOWS``, its default and its reader.

Every key of the ``K2B_WORKFLOWS`` setting is read here, once, through a small
function, so the defaults are documented in one place and tests can change a
value with ``override_settings`` without restarting anything.

=============================  ==========  ==========================================
key                            default     meaning
=============================  ==========  ==========================================
``RUN_LEASE_MS``               30000       how long a claim lasts without renewal
``RUN_MAX_CONSECUTIVE_FAILURES`` 5         retryable failures or crashes in a row
                                           before a run fails (or needs attention)
``RETRY_BACKOFF_MS``           1000        first retry delay, doubled each time
``RETRY_BACKOFF_MAX_MS``       300000      cap of the retry delay
``POLL_INTERVAL_MS``           1000        idle workers poll this often even when no
                                           notification arrives (the safety net)
``MAX_CHILDREN_PER_STEP``      1000        fan-out bound of one ``run.children`` call
``ACTION_TIMEOUT_MS``          300000      leases are renewed at most this long while
                                           one action runs (``Action.timeout`` wins)
``CLAIM_PREFETCH``             4           runs a worker process claims ahead of its
                                           free threads, so a thread that finishes a
                                           run starts the next without waiting for a
                                           claim (leases renewed; handed back on stop);
                                           the floor: on a backlog of short runs it
                                           grows up to 0.1 s of its threads' work
                                           (``worker/prefetch.py``); 0 disables it
``SHUTDOWN_GRACE_MS``          20000       after SIGTERM, how long steps in flight may
                                           finish before the worker hands their runs
                                           back and exits (keep it below the
                                           supervisor's stop timeout)
``MAX_VALUE_BYTES``            1048576     largest JSON value stored (run input and output,
                                           principal, step output, AI request and
                                           answer, resolution output and evidence),
                                           serialized as UTF-8; larger is InvalidInput
``AI_TASK_MAX_ATTEMPTS``       3           provider calls of one AI task whose worker
                                           crashed or froze before the task fails
                                           (the step fails ``AI_TASK_FAILED``)
``MAX_RECONCILE_POLLS``        100         ``reconcile()`` answers "pending" (waiting)
                                           at most this often per dispatch; then the
                                           run needs an operator
``WAKE_RETENTION_HOURS``       168         a wait rendezvous no run is parked on is
                                           deleted by workers this long after its last
                                           wake (a waiter parking later misses it)
``DATABASE``                   "default"   the alias holding the kernel's tables; web
                                           and workers connect with the runtime role
``OWNER_DATABASE``             None        the alias that connects as the tables' owner,
                                           used by ``purgeworkflows`` (None: ``DATABASE``)
``EVIDENCE_KEYS``              None        secrets keying the evidence hashes, chains and
                                           anchors, newest first: the first signs, all
                                           verify. None: derived from ``SECRET_KEY`` and
                                           then ``SECRET_KEY_FALLBACKS``
``REDACT_KEYS``                see below   JSON keys whose values the admin never shows,
                                           matched as substrings, ignoring case, ``_``,
                                           ``-`` and ``.`` (``token`` hides ``card_token``)
``REDACT_EXACT_KEYS``          see below   keys hidden only on an exact (normalized)
                                           match: short names like ``pan`` or ``pin``
                                           that would hide innocent keys as substrings
``REDACT_HOOK``                None        dotted path to (or a) callable receiving each
                                           redacted JSON value and returning what to show
``ERROR_TEXT_MAX_CHARS``       2000        exception texts stored or logged are scrubbed
                                           of credentials and cut to this length
``ADMIN_RUN_PAGE_ROWS``        100         journal and ledger rows shown on a run's page;
                                           the rest is one link away (filtered list)
``LISTEN_DATABASE``            None        the alias whose connection settings the
                                           workers' LISTEN connection uses (None: the
                                           ``DATABASE`` alias). Point it at a direct
                                           connection when ``DATABASE`` goes through
                                           PgBouncer in transaction pooling mode, which
                                           does not deliver notifications
``WORKER_HEARTBEAT_MS``        None        how often a worker refreshes its row in the
                                           fleet table; None: a third of the lease
``WORKER_LOST_AFTER_MS``       None        a worker whose heartbeat is older than this
                                           is marked lost; None: three leases
``WORKER_PURGE_AFTER_MS``      604800000   rows of stopped or lost workers are deleted
                                           this long after their last heartbeat (7 days)
``PRIORITY_AGING_MS``          60000       queueing this long counts as one level of
                                           ``priority``: a run stands in line at
                                           ``run_after - priority x PRIORITY_AGING_MS``
                                           (taken when it starts), so a run of priority
                                           0 waits at most ``p x PRIORITY_AGING_MS``
                                           behind runs of priority ``p`` started later
``RATE_LIMIT_MARGIN_MS``       100         a rate-limited dispatch occupies its window
                                           for ``per`` plus this long: the window is
                                           timed on PostgreSQL's clock as the dispatch
                                           is admitted, and the provider sees the call
                                           a commit later, a delay that varies from call
                                           to call (0: windows of exactly ``per``)
``SCHEDULE_MAX_CATCH_UP``      100         ``catch_up="all"``: missed ticks one schedule
                                           pass starts per schedule, in order; the
                                           next pass goes on with the rest
``SCHEDULE_MISSED_AFTER_MS``   60000       a tick a pass sees this long after it was due
                                           (the fleet was down) is missed: its schedule's
                                           ``catch_up`` decides; ``workflowstatus``
                                           reports a schedule this late
``SCHEDULE_PASS_INTERVAL_MS``  1000        how often a worker asks whether a tick is due
                                           (one indexed read); it also wakes for the
                                           next tick it learned of
``WITNESS_SINK``               None        dotted path to (or a) callable receiving each
                                           witness record (a dict) of a dispatch or a
                                           run's end; None: the ``k2b_workflows.witness``
                                           logger at INFO (dropped unless configured).
                                           Ship it out of the database's reach: it is
                                           what ``verifyworkflows --witness`` holds a
                                           restored or rolled-back database against
=============================  ==========  ==========================================

Evidence keys never live in the database: whoever can write the tables but
does not hold a key cannot recompute a chain or an anchor. Each entry records
the id of the key it was made with (a short digest of the key, not the key),
so rotating is adding a new secret in front and keeping the old ones until
``verifyworkflows`` no longer needs them, exactly like ``SECRET_KEY_FALLBACKS``.
``REDACT_KEYS`` defaults to ``DEFAULT_REDACT_KEYS`` and ``REDACT_EXACT_KEYS`` to
``DEFAULT_REDACT_EXACT_KEYS``; set them to a longer list to redact more (keep
the defaults in it: they are replaced, not extended).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from . import codes

#: Default lease of a claimed run, in milliseconds.
WORKFLOW_RUN_LEASE_MS = 30_000
#: Default number of consecutive failures (retryable failures or crashes) tolerated.
WORKFLOW_RUN_MAX_CONSECUTIVE_FAILURES = 5
WORKFLOW_RETRY_BACKOFF_MS = 1_000
WORKFLOW_RETRY_BACKOFF_MAX_MS = 300_000
WORKFLOW_POLL_INTERVAL_MS = 1_000
WORKFLOW_MAX_CHILDREN_PER_STEP = 1_000
WORKFLOW_ACTION_TIMEOUT_MS = 300_000
WORKFLOW_CLAIM_PREFETCH = 4
WORKFLOW_SHUTDOWN_GRACE_MS = 20_000
#: 1 MiB: far below PostgreSQL's 255 MB jsonb and 1 GB text limits, so a value
#: is refused at the boundary instead of failing after minutes inside the server.
WORKFLOW_MAX_VALUE_BYTES = 1_048_576
WORKFLOW_AI_TASK_MAX_ATTEMPTS = 3
WORKFLOW_MAX_RECONCILE_POLLS = 100
WORKFLOW_WAKE_RETENTION_HOURS = 168
WORKFLOW_WORKER_PURGE_AFTER_MS = 7 * 24 * 3600 * 1000
WORKFLOW_PRIORITY_AGING_MS = 60_000
WORKFLOW_RATE_LIMIT_MARGIN_MS = 100
#: Missed ticks a schedule pass starts per schedule under ``catch_up="all"``.
SCHEDULE_MAX_CATCH_UP = 100
SCHEDULE_MISSED_AFTER_MS = 60_000
SCHEDULE_PASS_INTERVAL_MS = 1_000

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

DEFAULT_REDACT_KEYS: tuple[str, ...] = (
    "password",
    "passwd",
    "passphrase",
    "secret",
    "token",
    "api_key",
    "apikey",
    "access_key",
    "private_key",
    "authorization",
    "credential",
    "cookie",
    "session",
    "signature",
    "card_number",
    "cardnumber",
    "cvv",
    "cvc",
    "security_code",
    "iban",
)
DEFAULT_REDACT_EXACT_KEYS: tuple[str, ...] = ("pan", "pin", "ssn", "auth", "otp")

_DEFAULTS: dict[str, Any] = {
    "RUN_LEASE_MS": WORKFLOW_RUN_LEASE_MS,
    "RUN_MAX_CONSECUTIVE_FAILURES": WORKFLOW_RUN_MAX_CONSECUTIVE_FAILURES,
    "RETRY_BACKOFF_MS": WORKFLOW_RETRY_BACKOFF_MS,
    "RETRY_BACKOFF_MAX_MS": WORKFLOW_RETRY_BACKOFF_MAX_MS,
    "POLL_INTERVAL_MS": WORKFLOW_POLL_INTERVAL_MS,
    "MAX_CHILDREN_PER_STEP": WORKFLOW_MAX_CHILDREN_PER_STEP,
    "ACTION_TIMEOUT_MS": WORKFLOW_ACTION_TIMEOUT_MS,
    "CLAIM_PREFETCH": WORKFLOW_CLAIM_PREFETCH,
    "SHUTDOWN_GRACE_MS": WORKFLOW_SHUTDOWN_GRACE_MS,
    "MAX_VALUE_BYTES": WORKFLOW_MAX_VALUE_BYTES,
    "AI_TASK_MAX_ATTEMPTS": WORKFLOW_AI_TASK_MAX_ATTEMPTS,
    "MAX_RECONCILE_POLLS": WORKFLOW_MAX_RECONCILE_POLLS,
    "WAKE_RETENTION_HOURS": WORKFLOW_WAKE_RETENTION_HOURS,
    "DATABASE": "default",
    "OWNER_DATABASE": None,
    "EVIDENCE_KEYS": None,
    "REDACT_KEYS": DEFAULT_REDACT_KEYS,
    "REDACT_EXACT_KEYS": DEFAULT_REDACT_EXACT_KEYS,
    "REDACT_HOOK": None,
    "ERROR_TEXT_MAX_CHARS": 2_000,
    "ADMIN_RUN_PAGE_ROWS": 100,
    "LISTEN_DATABASE": None,
    "WORKER_HEARTBEAT_MS": None,
    "WORKER_LOST_AFTER_MS": None,
    "WORKER_PURGE_AFTER_MS": WORKFLOW_WORKER_PURGE_AFTER_MS,
    "PRIORITY_AGING_MS": WORKFLOW_PRIORITY_AGING_MS,
    "RATE_LIMIT_MARGIN_MS": WORKFLOW_RATE_LIMIT_MARGIN_MS,
    "SCHEDULE_MAX_CATCH_UP": SCHEDULE_MAX_CATCH_UP,
    "SCHEDULE_MISSED_AFTER_MS": SCHEDULE_MISSED_AFTER_MS,
    "SCHEDULE_PASS_INTERVAL_MS": SCHEDULE_PASS_INTERVAL_MS,
    "WITNESS_SINK": None,
}


def _get(key: str) -> Any:
    return getattr(settings, "K2B_WORKFLOWS", {}).get(key, _DEFAULTS[key])


def known_settings() -> frozenset[str]:
    return frozenset(_DEFAULTS)


def lease_ms() -> int:
    return int(_get("RUN_LEASE_MS"))


def max_consecutive_failures() -> int:
    return int(_get("RUN_MAX_CONSECUTIVE_FAILURES"))


def retry_backoff_ms() -> int:
    return int(_get("RETRY_BACKOFF_MS"))


def retry_backoff_max_ms() -> int:
    return int(_get("RETRY_BACKOFF_MAX_MS"))


def poll_interval_ms() -> int:
    return int(_get("POLL_INTERVAL_MS"))


def max_children_per_step() -> int:
    return int(_get("MAX_CHILDREN_PER_STEP"))


def action_timeout_ms() -> int:
    return int(_get("ACTION_TIMEOUT_MS"))


def claim_prefetch() -> int:
    return int(_get("CLAIM_PREFETCH"))


def shutdown_grace_ms() -> int:
    return int(_get("SHUTDOWN_GRACE_MS"))


def max_value_bytes() -> int:
    return int(_get("MAX_VALUE_BYTES"))


def ai_task_max_attempts() -> int:
    return int(_get("AI_TASK_MAX_ATTEMPTS"))


def max_reconcile_polls() -> int:
    return int(_get("MAX_RECONCILE_POLLS"))


def wake_retention_hours() -> int:
    return int(_get("WAKE_RETENTION_HOURS"))


def schedule_max_catch_up() -> int:
    return int(_get("SCHEDULE_MAX_CATCH_UP"))


def schedule_missed_after_ms() -> int:
    return int(_get("SCHEDULE_MISSED_AFTER_MS"))


def schedule_missed_after() -> dt.timedelta:
    return dt.timedelta(milliseconds=schedule_missed_after_ms())


def schedule_pass_interval_ms() -> int:
    return int(_get("SCHEDULE_PASS_INTERVAL_MS"))


def database() -> str:
    return str(_get("DATABASE"))


def owner_database() -> str:
    """The alias connected as the owner of the tables: the only one that may purge."""
    return str(_get("OWNER_DATABASE") or database())


def witness_sink() -> Any:
    """The callable witness records go to, or None for the ``k2b_workflows.witness`` logger."""
    sink = _get("WITNESS_SINK")
    if isinstance(sink, str):
        from django.utils.module_loading import import_string

        sink = import_string(sink)
    if sink is not None and not callable(sink):
        raise ImproperlyConfigured("K2B_WORKFLOWS['WITNESS_SINK'] must be a callable or None")
    return sink


def evidence_key_secrets() -> Any:
    """The ``EVIDENCE_KEYS`` setting as given (None: derive from ``SECRET_KEY``).

    The keys themselves are derived, checked and cached in ``kernel/keys.py``.
    """
    return _get("EVIDENCE_KEYS")


def redact_keys() -> tuple[str, ...]:
    return tuple(str(k) for k in _get("REDACT_KEYS"))


def redact_exact_keys() -> tuple[str, ...]:
    return tuple(str(k) for k in _get("REDACT_EXACT_KEYS"))


def redact_hook() -> Any:
    """A dotted path to a callable, the callable itself, or None."""
    return _get("REDACT_HOOK")


def error_text_max_chars() -> int:
    return int(_get("ERROR_TEXT_MAX_CHARS"))


def admin_run_page_rows() -> int:
    return int(_get("ADMIN_RUN_PAGE_ROWS"))


def listen_database() -> str:
    """The alias the LISTEN connection is opened with (LISTEN needs a session of its own)."""
    alias = _get("LISTEN_DATABASE")
    return str(alias) if alias else database()


def worker_heartbeat_ms() -> int:
    """A third of the lease: a worker misses two beats before anyone could call it late."""
    value = _get("WORKER_HEARTBEAT_MS")
    return int(value) if value else max(lease_ms() // 3, 100)


def worker_lost_after_ms() -> int:
    """Three leases: by then every run the worker held has been taken over anyway."""
    value = _get("WORKER_LOST_AFTER_MS")
    return int(value) if value else 3 * lease_ms()


def worker_purge_after_ms() -> int:
    return int(_get("WORKER_PURGE_AFTER_MS"))


#: The LISTEN/NOTIFY channel. Fixed: the database triggers name it.
CHANNEL = "k2b_workflows"


def priority_aging_ms() -> int:
    return int(_get("PRIORITY_AGING_MS"))


def rate_limit_margin_ms() -> int:
    return int(_get("RATE_LIMIT_MARGIN_MS"))


def backoff_ms(failures: int) -> int:
    """Delay before retry number ``failures`` (1-based): doubled each time, capped."""
    if failures <= 0:
        return 0
    return min(retry_backoff_ms() * 2 ** min(failures - 1, 30), retry_backoff_max_ms())
