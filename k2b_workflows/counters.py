"""Prometheus counters, through ``prometheus_client`` when it is installed.

``pip install k2b-workflows[metrics]``. Without the package every ``count_*``
function is a no-op and ``serve``/``metrics_view`` say what is missing, so
the kernel calls them unconditionally.

Two kinds of numbers:

- counters and the step latency histogram live in the process that does the
  work (the worker): ``runworkflows --metrics-port`` serves them;
- gauges of the shared state (runs by status, queue depth, age of the oldest
  queued run, open incidents, live workers) are read from the database at
  scrape time by ``DatabaseCollector``, so any one scrape target tells the
  truth of the whole fleet, and a web process can serve them
  (``metrics_view``; with ``PROMETHEUS_MULTIPROC_DIR`` set it also merges
  the counters of every process of a multiprocess server).

This module holds the counters and the histogram: the kernel counts through
it, so it sits below the kernel. The gauges' collector, the HTTP server and
the view read the kernel's tables and so live above it, in ``metrics.py``,
which re-exports everything here.

Database reconnects are counted by whoever reconnects:
``count_db_reconnect(component)``, e.g. ``"heartbeat"``, ``"listener"``,
``"lease_keeper"``, ``"loop"``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

AVAILABLE = importlib.util.find_spec("prometheus_client") is not None

#: Step latency buckets in seconds: from a PURE step's commit to a slow provider call.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

_metrics: dict[str, Any] = {}
# Pool threads count their first steps at the same moment: one creates the metrics.
_create_lock = threading.Lock()

F = TypeVar("F", bound=Callable[..., None])


def _never_raises(fn: F) -> F:
    """Counting is called from inside the kernel: a broken metric must not fail a run."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception:
            logger.exception("metrics: %s failed", fn.__name__)

    return wrapper  # type: ignore[return-value]


def _get(name: str) -> Any:
    """The metric called ``name``, created on first use (None without prometheus_client)."""
    if not AVAILABLE:
        return None
    if not _metrics:
        with _create_lock:
            if not _metrics:
                _create()
    return _metrics[name]


def _create() -> None:
    from prometheus_client import Counter, Histogram

    _metrics.update(
        steps=Counter(
            "k2b_steps",
            "Steps that reached an outcome, by effect class and outcome.",
            ["effect", "outcome"],
        ),
        step_seconds=Histogram(
            "k2b_step_duration_seconds",
            "Time from a step's start to its journal entry, by effect class.",
            ["effect"],
            buckets=LATENCY_BUCKETS,
        ),
        transitions=Counter(
            "k2b_run_transitions",
            "Run state changes made by this process, by new status.",
            ["status"],
        ),
        takeovers=Counter(
            "k2b_lease_takeovers",
            "Runs re-queued because their lease expired (a crashed or frozen worker).",
        ),
        reconcile=Counter(
            "k2b_reconcile_answers",
            "Answers of reconcile() after a doubted external effect.",
            ["answer"],
        ),
        rate_deferrals=Counter(
            "k2b_rate_limit_deferrals",
            "Steps deferred because their action's rate limit was full, by action.",
            ["action"],
        ),
        reconnects=Counter(
            "k2b_db_reconnects",
            "Database connections re-opened after an error, by component.",
            ["component"],
        ),
        schedule_skips=Counter(
            "k2b_schedule_ticks_skipped",
            "Schedule ticks that started no run, by reason (overlap, buffer_full, catch_up).",
            ["reason"],
        ),
        schedule_lag=Histogram(
            "k2b_schedule_lag_seconds",
            "Time from a tick's fire time to the pass that queued its run.",
            buckets=LATENCY_BUCKETS,
        ),
    )


@_never_raises
def prepare() -> None:
    """Import ``prometheus_client`` and create the metrics now, not at the first step.

    A worker calls this before it claims: otherwise a pool thread pays for the
    import, with the import lock and the GIL held, in the middle of its first
    run (docs/performance.md).
    """
    if AVAILABLE:
        _get("steps")


@functools.cache
def _step_children(effect: str, outcome: str) -> tuple[Any, Any]:
    """The labelled step counter and histogram (``labels()`` costs more than ``inc()``)."""
    return (
        _get("steps").labels(effect=effect, outcome=outcome),
        _get("step_seconds").labels(effect=effect),
    )


@_never_raises
def count_step(effect: str, outcome: str, seconds: float | None = None) -> None:
    if not AVAILABLE:
        return
    steps, step_seconds = _step_children(effect, outcome)
    steps.inc()
    if seconds is not None:
        step_seconds.observe(max(seconds, 0.0))


@functools.cache
def _transition_child(status: str) -> Any:
    """The labelled transitions counter: every run's end counts one."""
    return _get("transitions").labels(status=status)


@_never_raises
def count_run_transition(status: str) -> None:
    if AVAILABLE:
        _transition_child(status).inc()


@_never_raises
def count_lease_takeovers(n: int) -> None:
    if n and (takeovers := _get("takeovers")) is not None:
        takeovers.inc(n)


@_never_raises
def count_reconcile_answer(answer: str) -> None:
    if (reconcile := _get("reconcile")) is not None:
        reconcile.labels(answer=answer).inc()


@_never_raises
def count_rate_deferral(action: str) -> None:
    if (deferrals := _get("rate_deferrals")) is not None:
        deferrals.labels(action=action).inc()


@_never_raises
def count_db_reconnect(component: str) -> None:
    """Count one database reconnection of ``component`` (the heartbeat, the listener, ...)."""
    if (reconnects := _get("reconnects")) is not None:
        reconnects.labels(component=component).inc()


@_never_raises
def count_schedule_skips(reason: str, n: int = 1) -> None:
    """Count ``n`` ticks that started no run because of ``reason`` (overlap, catch_up, ...)."""
    if n and (skips := _get("schedule_skips")) is not None:
        skips.labels(reason=reason).inc(n)


@_never_raises
def observe_schedule_lag(seconds: float) -> None:
    """A tick's run was queued ``seconds`` after the tick's fire time."""
    if (lag := _get("schedule_lag")) is not None:
        lag.observe(max(seconds, 0.0))


__all__ = [
    "AVAILABLE",
    "LATENCY_BUCKETS",
    "count_db_reconnect",
    "count_lease_takeovers",
    "count_rate_deferral",
    "count_reconcile_answer",
    "count_run_transition",
    "count_schedule_skips",
    "count_step",
    "observe_schedule_lag",
    "prepare",
]
