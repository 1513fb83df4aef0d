"""Prometheus metrics: the workers' counters, and the fleet's gauges read at scrape time.

``pip install k2b-workflows[metrics]``. Without ``prometheus_client`` every
``count_*`` function is a no-op and ``serve``/``metrics_view`` say what is
missing.

Two kinds of numbers:

- counters and the step latency histogram live in the process that does the
  work (the worker), in ``counters.py``, below the kernel that counts through
  them; ``runworkflows --metrics-port`` serves them (``serve``);
- gauges of the shared state (runs by status, queue depth, age of the oldest
  queued run, open incidents, live workers, late schedules, keys with a
  queue) are read from the database at scrape time by ``DatabaseCollector``,
  so any one scrape target tells the truth of the whole fleet, and a web
  process can serve them (``metrics_view``; with ``PROMETHEUS_MULTIPROC_DIR``
  set it also merges the counters of every process of a multiprocess server).

Route the view yourself and protect it like any internal endpoint::

    path("metrics", k2b_workflows.metrics.metrics_view)
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from . import settings
from .counters import (
    AVAILABLE,
    LATENCY_BUCKETS,
    count_db_reconnect,
    count_lease_takeovers,
    count_rate_deferral,
    count_reconcile_answer,
    count_run_transition,
    count_schedule_skips,
    count_step,
    observe_schedule_lag,
    prepare,
)
from .fleet import queue_counts
from .kernel import db, flow, schedule_passes

logger = logging.getLogger(__name__)

_serve_lock = threading.Lock()
_collectors: list[DatabaseCollector] = []


class DatabaseCollector:
    """Gauges of the shared state, read from the database at scrape time.

    Reads on a connection of its own, opened and closed per scrape: a scrape
    must not borrow (or leave a transaction open on) a worker thread's
    connection. A scrape during a database outage reports
    ``k2b_database_up 0`` instead of failing.
    """

    def __init__(self, using: str | None = None) -> None:
        self.using = using or settings.database()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        up = GaugeMetricFamily("k2b_database_up", "1 when the last scrape could read the database.")
        try:
            conn = db.autocommit_connection(self.using)
        except Exception as exc:
            logger.warning("metrics: database unreachable: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        try:
            with conn.cursor() as cursor:
                runs, depth, oldest, live = queue_counts(cursor)
                late_schedules = schedule_passes.late_count(cursor)
                behind, keys = flow.flow_counts(cursor)
        except Exception as exc:
            logger.warning("metrics: database query failed: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        finally:
            conn.close()
        up.add_metric([], 1)
        yield up
        from .models import RunStatus

        by_status = GaugeMetricFamily("k2b_runs", "Runs by status.", labels=["status"])
        for status in RunStatus.values:
            by_status.add_metric([status], runs.get(status, 0))
        yield by_status
        yield GaugeMetricFamily("k2b_queue_depth", "Queued runs that are due now.", value=depth)
        yield GaugeMetricFamily(
            "k2b_oldest_queued_age_seconds",
            "How long the oldest due queued run has waited (0: none).",
            value=max(oldest or 0.0, 0.0),
        )
        yield GaugeMetricFamily(
            "k2b_open_incidents",
            "Runs in needs_attention (an operator must decide).",
            value=runs.get("needs_attention", 0),
        )
        yield GaugeMetricFamily("k2b_live_workers", "Workers whose heartbeat is fresh.", value=live)
        yield GaugeMetricFamily(
            "k2b_schedules_late",
            "Schedules whose next tick is overdue by more than SCHEDULE_MISSED_AFTER_MS.",
            value=late_schedules,
        )
        yield GaugeMetricFamily(
            "k2b_queued_behind_key",
            "Queued runs waiting for a slot of their concurrency key.",
            value=behind,
        )
        yield GaugeMetricFamily(
            "k2b_keys_with_queue",
            "Concurrency keys with at least one run queued behind them.",
            value=keys,
        )


def serve(port: int, addr: str = "0.0.0.0", using: str | None = None) -> int:
    """Serve this process's metrics and the database gauges over HTTP; returns the port.

    ``port=0`` picks a free port (the worker logs it).
    """
    if not AVAILABLE:
        raise RuntimeError(
            "--metrics-port needs prometheus_client: pip install 'k2b-workflows[metrics]'"
        )
    from prometheus_client import REGISTRY, start_http_server

    prepare()  # create the counters so that a first scrape lists them at 0
    with _serve_lock:
        if not _collectors:
            _collectors.append(DatabaseCollector(using))
            REGISTRY.register(_collectors[0])
    server, _thread = start_http_server(port, addr=addr, registry=REGISTRY)
    return int(server.server_port)


def metrics_view(request: Any) -> Any:
    """A Django view with the database gauges (and, in multiprocess mode, every process's counters).

    Route it yourself and protect it like any internal endpoint::

        path("metrics", k2b_workflows.metrics.metrics_view)
    """
    from django.http import HttpResponse

    if not AVAILABLE:
        return HttpResponse(
            "prometheus_client is not installed: pip install 'k2b-workflows[metrics]'\n",
            status=501,
            content_type="text/plain",
        )
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry)
    registry.register(DatabaseCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


__all__ = [
    "AVAILABLE",
    "LATENCY_BUCKETS",
    "DatabaseCollector",
    "count_db_reconnect",
    "count_lease_takeovers",
    "count_rate_deferral",
    "count_reconcile_answer",
    "count_run_transition",
    "count_schedule_skips",
    "count_step",
    "metrics_view",
    "observe_schedule_lag",
    "prepare",
    "serve",
]
