"""The ``K2B_WORKFLOWS`` setting: every key once, with its default, its meaning and its reader.

Each key is declared once below (``SETTINGS``): its default is written
nowhere else. The readers (``lease_ms()``, ``database()``...) read the
setting at each call (from the ``K2B_WORKFLOWS`` dict, looked up once and again
after ``setting_changed``), so a test changes a value with ``override_settings``
without restarting anything; a system check refuses unknown keys
(``known_settings``); the reference's table (docs/reference.md) is the
declarations rendered (``reference_table``), and a test keeps it so.
``store`` re-exports the readers and the historical ``WORKFLOW_*`` constants.

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
from dataclasses import dataclass
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

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


@dataclass(frozen=True)
class Setting:
    """One key of ``K2B_WORKFLOWS``: its default and what it means."""

    key: str
    default: Any
    meaning: str
    #: How the reference shows the default, when its repr would not read well.
    shown: str | None = None

    def value(self) -> Any:
        return _section().get(self.key, self.default)

    def shown_default(self) -> str:
        if self.shown is not None:
            return self.shown
        if self.default is None or isinstance(self.default, str):
            return f"`{self.default!r}`".replace("'", '"')
        return str(self.default)


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "RUN_LEASE_MS",
        30_000,
        "how long a claim lasts without renewal",
    ),
    Setting(
        "RUN_MAX_CONSECUTIVE_FAILURES",
        5,
        "failures in a row before the run fails or needs attention",
    ),
    Setting(
        "RETRY_BACKOFF_MS",
        1_000,
        "first retry delay, doubled each time",
    ),
    Setting(
        "RETRY_BACKOFF_MAX_MS",
        300_000,
        "cap of the retry delay",
    ),
    Setting(
        "POLL_INTERVAL_MS",
        1_000,
        "idle workers poll this often without notifications",
    ),
    Setting(
        "MAX_CHILDREN_PER_STEP",
        1_000,
        "fan-out bound of one call",
    ),
    Setting(
        "ACTION_TIMEOUT_MS",
        300_000,
        "default `Action.timeout`",
    ),
    Setting(
        "CLAIM_PREFETCH",
        4,
        (
            "runs a worker process claims ahead of its free threads (leases renewed while they "
            "wait, handed back on stop; 0 disables). The floor: on a backlog of short runs the "
            "worker claims further ahead, up to what its threads get through in 0.1 s (at most "
            "64 runs)"
        ),
    ),
    Setting(
        "PURE_ENDS_TOGETHER",
        8,
        (
            "at most this many pure ends in one commit: after a quick run whose end writes only "
            "pure work (a pure task, a run whose last steps are PURE), a worker thread runs the "
            "next claimed run of the same workflow or task before it commits, for up to 20 ms, "
            "and commits their ends together (1: each end commits alone). A worker killed before "
            "that commit loses those ends, and those runs run again, as PURE work does after any "
            "crash"
        ),
    ),
    Setting(
        "SHUTDOWN_GRACE_MS",
        20_000,
        (
            "after SIGTERM, how long steps in flight may finish before their runs are handed "
            "back; an external call in flight is waited for until it returns, however long "
            "(only a second SIGTERM or a SIGKILL cuts it)"
        ),
    ),
    Setting(
        "MAX_VALUE_BYTES",
        1_048_576,
        (
            "largest JSON value stored (run input, principal, outputs, AI requests and answers, "
            "resolution output and evidence), as UTF-8; larger is `InvalidInput` (or an invalid "
            "result inside a run)"
        ),
    ),
    Setting(
        "AI_TASK_MAX_ATTEMPTS",
        3,
        (
            "provider calls of one AI task lost with their worker before the step fails "
            "`AI_TASK_FAILED`"
        ),
    ),
    Setting(
        "MAX_RECONCILE_POLLS",
        100,
        '`reconcile()` answers "pending" per dispatch before the run needs an operator',
    ),
    Setting(
        "WAKE_RETENTION_HOURS",
        168,
        "workers delete a wait rendezvous no run is parked on this long after its last wake",
    ),
    Setting(
        "DATABASE",
        "default",
        "the alias holding the kernel's tables (the runtime role)",
    ),
    Setting(
        "OWNER_DATABASE",
        None,
        "the alias connected as the tables' owner, for `purgeworkflows` (None: `DATABASE`)",
    ),
    Setting(
        "EVIDENCE_KEYS",
        None,
        (
            "secrets keying evidence hashes, chains and anchors, newest first (None: "
            "`SECRET_KEY`, then `SECRET_KEY_FALLBACKS`); see [security](security.md)"
        ),
    ),
    Setting(
        "REDACT_KEYS",
        DEFAULT_REDACT_KEYS,
        "JSON keys never shown in the admin (substring match)",
        shown="`store.DEFAULT_REDACT_KEYS`",
    ),
    Setting(
        "REDACT_EXACT_KEYS",
        DEFAULT_REDACT_EXACT_KEYS,
        "keys never shown, whole-key match (`pan`, `pin`, …)",
        shown="`store.DEFAULT_REDACT_EXACT_KEYS`",
    ),
    Setting(
        "REDACT_HOOK",
        None,
        "dotted path to a callable that redacts more",
    ),
    Setting(
        "ERROR_TEXT_MAX_CHARS",
        2_000,
        "stored and logged exception texts are scrubbed and cut to this",
    ),
    Setting(
        "ADMIN_RUN_PAGE_ROWS",
        100,
        "journal and ledger rows on a run's page",
    ),
    Setting(
        "LISTEN_DATABASE",
        None,
        (
            "alias whose connection settings the LISTEN connection uses (None: `DATABASE`); a "
            "direct connection when `DATABASE` goes through PgBouncer"
        ),
    ),
    Setting(
        "WORKER_HEARTBEAT_MS",
        None,
        "how often a worker refreshes its fleet row (None: a third of the lease)",
    ),
    Setting(
        "WORKER_LOST_AFTER_MS",
        None,
        "a silent worker is lost after this (None: three leases)",
    ),
    Setting(
        "WORKER_PURGE_AFTER_MS",
        7 * 24 * 3600 * 1000,
        "rows of stopped or lost workers are deleted after this (7 days)",
    ),
    Setting(
        "PRIORITY_AGING_MS",
        60_000,
        "queueing this long counts as one level of `priority` (taken when a run starts)",
    ),
    Setting(
        "RATE_LIMIT_MARGIN_MS",
        100,
        (
            "a rate-limited dispatch occupies its window for `per` plus this (the call reaches "
            "the provider a commit after its admission)"
        ),
    ),
    Setting(
        "SCHEDULE_MAX_CATCH_UP",
        100,
        (
            '`catch_up="all"`: missed ticks one pass starts per schedule, in order '
            "(the next pass goes on)"
        ),
    ),
    Setting(
        "SCHEDULE_MISSED_AFTER_MS",
        60_000,
        (
            "a tick seen this long after it was due is missed (`catch_up` decides); "
            "`workflowstatus` reports a schedule this late"
        ),
    ),
    Setting(
        "SCHEDULE_PASS_INTERVAL_MS",
        1_000,
        (
            "how often a worker asks whether a tick is due (it also wakes for the next tick it "
            "learned of)"
        ),
    ),
    Setting(
        "WITNESS_SINK",
        None,
        (
            "callable (or dotted path) receiving each witness record of a dispatch or a run's "
            "end; `None`: the `k2b_workflows.witness` logger at INFO (see "
            "[security](security.md#the-witness))"
        ),
    ),
)
BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}


def default(key: str) -> Any:
    """The default of ``key``, as declared above."""
    return BY_KEY[key].default


def reference_table() -> str:
    """The settings table of docs/reference.md, rendered from the declarations."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{s.key}` | {s.shown_default()} | {s.meaning} |" for s in SETTINGS]
    return "\n".join(lines)


#: The ``K2B_WORKFLOWS`` dict, looked up once: a worker reads about ten keys per
#: run, and each lookup through Django's lazy settings cost more than the rest of
#: the read. The dict itself is kept, not its values, so a change made inside it
#: is seen at once; a new dict (``override_settings``, pytest-django's
#: ``settings``) is seen after ``setting_changed``, which those send.
_cached_section: dict[str, Any] | None = None


def _section() -> dict[str, Any]:
    global _cached_section
    section = _cached_section
    if section is None:
        section = _cached_section = getattr(django_settings, "K2B_WORKFLOWS", {})
    return section


def _forget_section(*, setting: str, **kwargs: Any) -> None:
    global _cached_section
    if setting == "K2B_WORKFLOWS":
        _cached_section = None


setting_changed.connect(_forget_section, dispatch_uid="k2b_workflows.settings.section")


def _get(key: str) -> Any:
    return _section().get(key, BY_KEY[key].default)


def known_settings() -> frozenset[str]:
    return frozenset(BY_KEY)


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


def pure_ends_together() -> int:
    return int(_get("PURE_ENDS_TOGETHER"))


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


def worker_fresh_ms() -> int:
    """How old a heartbeat may be for its worker to count as live: a lease, and at
    least three beats, never more than ``worker_lost_after_ms()``.

    Not the lost timeout: a SIGKILLed worker was called live by ``workflowstatus``
    for three leases (90 s by default), while the runs it held were taken over
    after one (#38). A live worker beats every third of a lease; one silent for
    a whole lease renews no lease either, so it can keep no run going.
    """
    return min(max(lease_ms(), 3 * worker_heartbeat_ms()), worker_lost_after_ms())


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
