"""The fleet: every worker process registers, beats, and is marked lost when it stops beating.

The failure this is built around: a worker dies (SIGKILL, OOM, a lost host)
and nobody notices until queued runs pile up. Each worker keeps a row in
``k2b_worker`` fresh from a thread of its own, on a connection of its own, so
that a worker whose every pool thread is busy in long steps still beats.
A row whose heartbeat is older than ``WORKER_LOST_AFTER_MS`` (database
clock) is not alive, whether or not anyone has marked it ``lost`` yet; every
beating worker and ``manage.py workflowstatus`` mark such rows, and rows of
stopped or lost workers are deleted after ``WORKER_PURGE_AFTER_MS``.

A heartbeat that fails (database restart, failover, a killed backend) is
weather: log one line, drop the connection, retry at the next beat. It never
stops the worker; at worst the row is marked lost and revived by the next
successful beat.

The fleet's gauges for Prometheus (``metrics.DatabaseCollector``) read
``queue_counts`` and ``live_workers`` from here at scrape time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from django.db import connections

from . import counters, settings
from .kernel import db, flow
from .workflows import registered_versions

logger = logging.getLogger(__name__)

_REGISTER_SQL = """
INSERT INTO k2b_worker (worker_id, host, pid, started_at, heartbeat_at, stopped_at, state,
                        concurrency, apps, workflows, in_flight)
VALUES (%s, %s, %s, k2b_now(), k2b_now(), NULL, 'alive', %s, %s, %s, %s)
ON CONFLICT (worker_id) DO UPDATE
   SET heartbeat_at = k2b_now(), stopped_at = NULL, state = 'alive', in_flight = EXCLUDED.in_flight
"""

_MARK_LOST_SQL = """
UPDATE k2b_worker SET state = 'lost'
 WHERE state = 'alive' AND heartbeat_at < k2b_now() - %s * interval '1 millisecond'
"""

_DEREGISTER_SQL = """
UPDATE k2b_worker SET state = 'stopped', stopped_at = k2b_now(), heartbeat_at = k2b_now(),
       in_flight = 0
 WHERE worker_id = %s
"""

_PURGE_SQL = """
DELETE FROM k2b_worker
 WHERE state IN ('stopped', 'lost') AND heartbeat_at < k2b_now() - %s * interval '1 millisecond'
"""


def capabilities(app_ids: Sequence[str] | None) -> list[dict[str, Any]]:
    """The workflows (name, version, app) a worker with this ``--app`` filter can claim."""
    return sorted(
        (
            # Every registered version: a worker keeps old versions until their runs drain.
            {"name": d.name, "version": d.version, "app_id": d.app_id}
            for d in registered_versions()
            if not app_ids or d.app_id in app_ids
        ),
        key=lambda c: (c["name"], c["version"]),
    )


class Heartbeat(threading.Thread):
    """Registers the worker, refreshes its row every ``WORKER_HEARTBEAT_MS``, deregisters it."""

    def __init__(
        self,
        *,
        using: str,
        worker_id: str,
        concurrency: int,
        app_ids: Sequence[str] | None,
        in_flight: Callable[[], int],
    ) -> None:
        super().__init__(name="k2b-heartbeat", daemon=True)
        self.using = using
        self.worker_id = worker_id
        self.concurrency = concurrency
        self.app_ids = list(app_ids or ())
        self.in_flight = in_flight
        self.stopping = threading.Event()
        #: Set after the first successful beat (tests and start-up logs wait on it).
        self.registered = threading.Event()
        self.beats = 0
        self.failures = 0
        self._conn: Any = None
        #: Set when the thread marked the row stopped itself, on its own connection.
        self.deregistered = False

    def run(self) -> None:
        interval = settings.worker_heartbeat_ms() / 1000
        while not self.stopping.is_set():
            self.beat()
            self.stopping.wait(interval)
        # On the connection the beats used, when it is still open: no new one to say goodbye.
        if self._conn is not None and self._deregister(self._conn):
            self.deregistered = True
        self._close()

    def beat(self) -> bool:
        """One heartbeat; True when it reached the database."""
        import json

        try:
            if self._conn is None:
                self._conn = db.autocommit_connection(self.using)
                if self.failures:
                    counters.count_db_reconnect("heartbeat")
            self._conn.execute(
                _REGISTER_SQL,
                [
                    self.worker_id,
                    socket.gethostname(),
                    os.getpid(),
                    self.concurrency,
                    json.dumps(self.app_ids),
                    json.dumps(capabilities(self.app_ids)),
                    self.in_flight(),
                ],
            )
            # Any beating worker does the fleet's housekeeping: two tiny statements.
            self._conn.execute(_MARK_LOST_SQL, [settings.worker_lost_after_ms()])
            self._conn.execute(_PURGE_SQL, [settings.worker_purge_after_ms()])
        except Exception as exc:
            if self.failures == 0:
                logger.warning("heartbeat of %s failed: %s; retrying", self.worker_id, exc)
            self.failures += 1
            self._close()
            return False
        if self.failures:
            logger.info("heartbeat of %s back after %d failure(s)", self.worker_id, self.failures)
        self.failures = 0
        self.beats += 1
        self.registered.set()
        return True

    def stop(self) -> None:
        """Stop beating and mark the row stopped (best effort: a lost row is marked lost later)."""
        self.stopping.set()
        if self.is_alive():
            self.join(timeout=10)
        if self.deregistered:
            return
        try:
            conn = db.autocommit_connection(self.using)
        except Exception as exc:
            logger.warning("could not deregister %s: %s", self.worker_id, exc)
            return
        try:
            self._deregister(conn, warn=True)
        finally:
            with contextlib.suppress(Exception):
                conn.close()

    def _deregister(self, conn: Any, warn: bool = False) -> bool:
        try:
            conn.execute(_DEREGISTER_SQL, [self.worker_id])
        except Exception as exc:
            if warn:
                logger.warning("could not deregister %s: %s", self.worker_id, exc)
            return False
        return True

    def _close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None


def mark_lost(using: str | None = None) -> int:
    """Mark alive rows whose heartbeat is older than ``WORKER_LOST_AFTER_MS`` as lost."""
    return db.execute(
        using or settings.database(), _MARK_LOST_SQL, [settings.worker_lost_after_ms()]
    )


def purge(using: str | None = None, older_than_ms: int | None = None) -> int:
    """Delete rows of stopped or lost workers whose last heartbeat is older than the bound."""
    bound = settings.worker_purge_after_ms() if older_than_ms is None else older_than_ms
    return db.execute(using or settings.database(), _PURGE_SQL, [bound])


_LIVE = "state = 'alive' AND heartbeat_at >= k2b_now() - %s * interval '1 millisecond'"


_LIVE_WORKERS_SQL = f"""
SELECT worker_id, host, pid, concurrency, in_flight, workflows,
     EXTRACT(EPOCH FROM k2b_now() - heartbeat_at)
FROM k2b_worker WHERE {_LIVE} ORDER BY worker_id
"""


def live_workers(using: str | None = None) -> list[dict[str, Any]]:
    """Workers whose heartbeat is fresh, whatever their row says."""
    rows = db.fetchall(
        using or settings.database(),
        _LIVE_WORKERS_SQL,
        [settings.worker_fresh_ms()],
    )
    return [
        {
            "worker_id": r[0],
            "host": r[1],
            "pid": r[2],
            "concurrency": r[3],
            "in_flight": r[4],
            "workflows": db.from_json(r[5]),
            "heartbeat_age_s": round(float(r[6]), 3),
        }
        for r in rows
    ]


_STATUS_COUNTS_SQL = "SELECT status, count(*) FROM k2b_run GROUP BY status"

#: Runs due now, and how long the oldest of them has waited (seconds).
_DUE_SQL = """
SELECT count(*), EXTRACT(EPOCH FROM k2b_now() - min(run_after))
FROM k2b_run WHERE status = 'queued' AND run_after <= k2b_now()
"""

_LIVE_COUNT_SQL = f"SELECT count(*) FROM k2b_worker WHERE {_LIVE}"


def queue_counts(cursor: Any) -> tuple[dict[str, int], int, float | None, int]:
    """Runs by status, queued runs that are due, the oldest due one's age, live workers.

    ``cursor``: a Django cursor or a raw psycopg one (the metrics scrape reads on
    a connection of its own). Returns (counts, due, oldest age in seconds or
    None when nothing is due, live worker count).
    """
    cursor.execute(_STATUS_COUNTS_SQL)
    counts = dict(cursor.fetchall())
    cursor.execute(_DUE_SQL)
    due, oldest = cursor.fetchone()
    cursor.execute(_LIVE_COUNT_SQL, [settings.worker_fresh_ms()])
    live = cursor.fetchone()[0]
    return counts, int(due), None if oldest is None else float(oldest), int(live)


#: By task too: the runs of one task workflow are the calls of many tasks, and an
#: operator asks which tasks wait (#51).
_QUEUED_BY_WORKFLOW_SQL = """
SELECT workflow_name, workflow_version, app_id, task_path, count(*),
      EXTRACT(EPOCH FROM k2b_now() - min(created_at))
 FROM k2b_run WHERE status = 'queued'
GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4
"""


def status(using: str | None = None) -> dict[str, Any]:
    """What an on-call engineer asks first: counts, the oldest queued run, incidents, workers.

    ``unserved`` lists the (workflow, version) pairs with queued runs that no
    live worker can claim: those runs will wait forever. A task workflow's are
    listed per task (``task``: its path; "" for a workflow's runs).
    """
    using = using or settings.database()
    with connections[using].cursor() as cursor:
        counts, due, oldest, _ = queue_counts(cursor)
        cursor.execute(_QUEUED_BY_WORKFLOW_SQL)
        queued = cursor.fetchall()
        busiest = flow.busiest_keys(cursor, limit=5)
        behind, _ = flow.flow_counts(cursor)
    workers = live_workers(using)
    servable = {
        (c["name"], int(c["version"]), c["app_id"]) for w in workers for c in w["workflows"]
    }
    unserved = [
        {
            "workflow": name,
            "version": version,
            "app_id": app_id,
            "task": task_path,
            "queued": n,
            "oldest_age_s": round(float(age), 3),
        }
        for name, version, app_id, task_path, n, age in queued
        if (name, version, app_id) not in servable
    ]
    from .models import RunStatus

    return {
        "runs": {s: counts.get(s, 0) for s in RunStatus.values},
        "queued_due": due,
        "oldest_queued_age_s": round(max(oldest, 0.0), 3) if oldest is not None else None,
        "open_incidents": counts.get("needs_attention", 0),
        "live_workers": workers,
        "unserved": unserved,
        "queued_behind_keys": behind,
        "busiest_keys": busiest,
    }


# -- Prometheus gauges of the shared state -------------------------------------------
