"""What the admin's overview page shows, read in a bounded time whatever the table's size.

The failure this guards against: a dashboard that counts a table of millions
of runs on every refresh, so that the page an on-call engineer opens during
an incident is itself slow and loads the database. Every read here is an
index scan bounded by the window shown or by a cap:

- the active statuses (queued, running, waiting, needs_attention) are counted
  through their partial or status index, each up to ``COUNT_CAP`` rows (the
  page then shows "100,000+");
- what finished in the window, per minute, per status and per error code, is
  one index-only scan of ``k2b_run_finished`` (``finished_at`` covering
  ``status`` and ``error_code``) over the window;
- what started, per minute, is an index-only scan of ``k2b_run_status``
  (``status``, ``created_at``) over the window;
- finished runs are counted over the window only, never since the beginning
  of time (that count grows with the table and says nothing about now).

``tests/test_overview.py`` checks the plans; ``bench/overview.py`` times them
on 1,000,000 runs.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from django.db import connections

from . import fleet, store
from .models import RunStatus

#: Active statuses are counted up to this many runs each: beyond, "100,000+".
COUNT_CAP = 100_000
#: The windows the page offers: name -> (length, label).
WINDOWS = {"hour": (dt.timedelta(hours=1), "last hour"), "day": (dt.timedelta(days=1), "last day")}
ACTIVE = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING, RunStatus.NEEDS_ATTENTION)
FINISHED = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELED)
#: Failing error codes are counted over the last hour, whatever the window.
FAILING_WINDOW = dt.timedelta(hours=1)

_ACTIVE_SQL = """
SELECT k2b_now(),
       (SELECT count(*) FROM (SELECT 1 FROM k2b_run WHERE status = 'queued' LIMIT %(cap)s) c),
       (SELECT count(*) FROM (SELECT 1 FROM k2b_run WHERE status = 'running' LIMIT %(cap)s) c),
       (SELECT count(*) FROM (SELECT 1 FROM k2b_run WHERE status = 'waiting' LIMIT %(cap)s) c),
       (SELECT count(*) FROM (SELECT 1 FROM k2b_run
                               WHERE status = 'needs_attention' LIMIT %(cap)s) c),
       (SELECT count(*) FROM (SELECT 1 FROM k2b_run
                               WHERE status = 'queued' AND run_after <= k2b_now()
                               LIMIT %(cap)s) c),
       (SELECT EXTRACT(EPOCH FROM k2b_now() - min(run_after)) FROM k2b_run
         WHERE status = 'queued' AND run_after <= k2b_now())
"""

_INCIDENTS_SQL = """
SELECT error_code, count(*) FROM (
    SELECT error_code FROM k2b_run WHERE status = 'needs_attention' LIMIT %(cap)s) i
 GROUP BY 1 ORDER BY 2 DESC, 1
"""

#: Buckets are minutes from the window's start (``date_bin``: no time zone enters the
#: grouping, and no ``numeric`` arithmetic per row).
_FINISHED_SQL = """
SELECT date_bin('1 minute', finished_at, %(since)s), status, error_code, count(*)
  FROM k2b_run
 WHERE finished_at >= %(since)s AND finished_at IS NOT NULL
 GROUP BY 1, 2, 3
"""

_STARTED_SQL = """
SELECT date_bin('1 minute', created_at, %(since)s), count(*)
  FROM k2b_run
 WHERE status = ANY(%(statuses)s) AND created_at >= %(since)s
 GROUP BY 1
"""

#: The statements of the page, for the test that reads their plans.
STATEMENTS = {
    "active": _ACTIVE_SQL,
    "incidents": _INCIDENTS_SQL,
    "finished": _FINISHED_SQL,
    "started": _STARTED_SQL,
}


@dataclass
class Overview:
    """One reading of the overview: counts now, and per-minute series over the window."""

    now: dt.datetime
    window: str
    minutes: int
    #: Active status -> count (capped at ``COUNT_CAP``).
    active: dict[str, int]
    #: Finished status -> count within the window.
    finished: dict[str, int]
    queued_due: int
    #: Seconds since the oldest due queued run became due; None when none is due.
    oldest_due_s: float | None
    incidents: list[tuple[str, int]]
    #: Error code -> failed runs in the last hour.
    failing: list[tuple[str, int]]
    started_per_minute: list[int]
    finished_per_minute: list[int]
    failed_per_minute: list[int]
    workers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def busy_threads(self) -> int:
        return sum(w["in_flight"] for w in self.workers)

    @property
    def threads(self) -> int:
        return sum(w["concurrency"] for w in self.workers)

    @property
    def since(self) -> dt.datetime:
        return self.now - dt.timedelta(minutes=self.minutes)


def parameters(window: str, now: dt.datetime) -> dict[str, Any]:
    """The statements' parameters for ``window`` ending at ``now`` (the database's clock)."""
    length, _ = WINDOWS[window]
    return {
        "cap": COUNT_CAP,
        "since": now - length,
        "statuses": list(RunStatus.values),
    }


def read(window: str = "hour", using: str | None = None) -> Overview:
    """Read the overview of ``window`` ("hour" or "day") in a handful of bounded statements."""
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {sorted(WINDOWS)}, not {window!r}")
    using = using or store.database()
    length, _ = WINDOWS[window]
    minutes = int(length.total_seconds() // 60)
    with connections[using].cursor() as cursor:
        cursor.execute(_ACTIVE_SQL, {"cap": COUNT_CAP})
        now, queued, running, waiting, attention, due, oldest = cursor.fetchone()
        params = parameters(window, now)
        cursor.execute(_INCIDENTS_SQL, params)
        incidents = [(code or "-", n) for code, n in cursor.fetchall()]
        cursor.execute(_FINISHED_SQL, params)
        finished_rows = cursor.fetchall()
        cursor.execute(_STARTED_SQL, params)
        started_rows = cursor.fetchall()
    since = params["since"]

    def minute_of(bucket: dt.datetime) -> int:
        return int((bucket - since).total_seconds() // 60)

    started = [0] * minutes
    for bucket, n in started_rows:
        minute = minute_of(bucket)
        if 0 <= minute < minutes:
            started[minute] += n
    finished_series = [0] * minutes
    failed_series = [0] * minutes
    finished = dict.fromkeys(FINISHED, 0)
    failing: dict[str, int] = {}
    failing_from = minutes - int(FAILING_WINDOW.total_seconds() // 60)
    for bucket, status, code, n in finished_rows:
        minute = minute_of(bucket)
        # A retried run had ended and is active again: it counts where it is now.
        if status not in finished:
            continue
        finished[status] += n
        if 0 <= minute < minutes:
            finished_series[minute] += n
            if status == RunStatus.FAILED:
                failed_series[minute] += n
        if status == RunStatus.FAILED and minute >= failing_from:
            failing[code or "-"] = failing.get(code or "-", 0) + n
    return Overview(
        now=now,
        window=window,
        minutes=minutes,
        active={
            RunStatus.QUEUED: queued,
            RunStatus.RUNNING: running,
            RunStatus.WAITING: waiting,
            RunStatus.NEEDS_ATTENTION: attention,
        },
        finished=finished,
        queued_due=due,
        oldest_due_s=None if oldest is None else max(0.0, float(oldest)),
        incidents=incidents,
        failing=sorted(failing.items(), key=lambda item: (-item[1], item[0])),
        started_per_minute=started,
        finished_per_minute=finished_series,
        failed_per_minute=failed_series,
        workers=fleet.live_workers(using),
    )
