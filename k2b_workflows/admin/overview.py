"""What the admin's overview page shows, read in a bounded time whatever the table's size.

The failure this guards against: a dashboard that counts a table of millions
of runs on every refresh, so that the page an on-call engineer opens during
an incident is itself slow and loads the database. Every read here is an
index scan bounded by the window shown or by a cap:

- the active statuses (queued, running, waiting, needs_attention) are counted
  through their partial or status index, each up to ``COUNT_CAP`` rows (the
  page then shows "100,000+");
- what finished, per minute, per status and per error code, is an index-only
  scan of ``k2b_run_finished`` (``finished_at`` covering ``status`` and
  ``error_code``); what started, per minute, one of ``k2b_run_status``
  (``status``, ``created_at``);
- and only over the minutes not yet in the rollup (``OverviewMinute``): a
  minute over for ``SETTLE`` is counted once, by the page that finds it
  missing, and read from there afterwards. The first page after a quiet
  spell reads its whole window; the next ones read the last few minutes;
- finished runs are counted over the window only, never since the beginning
  of time (that count grows with the table and says nothing about now).

``tests/admin/test_overview.py`` checks the plans; ``bench/overview.py`` times them
on 1,000,000 runs.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError, connections, transaction

from .. import fleet, settings
from ..models import OverviewMinute, RunStatus

logger = logging.getLogger(__name__)

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

#: Minutes are aligned on this origin (``date_bin``): whole UTC minutes, and no
#: ``numeric`` arithmetic per row.
EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
#: A minute is counted into the rollup once it has been over this long: a run's row
#: becomes visible at its commit, a little after the time it carries.
SETTLE = dt.timedelta(minutes=2)
#: Rollup rows older than this are deleted whenever a page adds new ones.
KEEP = dt.timedelta(days=2)
#: ``pg_try_advisory_xact_lock`` key: one page at a time adds minutes; the others read.
_ROLL_LOCK = 0x6B32_6F76_6572

_FINISHED_SQL = """
SELECT date_bin('1 minute', finished_at, %(epoch)s), status, error_code, count(*)
  FROM k2b_run
 WHERE finished_at >= %(from)s AND finished_at < %(until)s AND finished_at IS NOT NULL
 GROUP BY 1, 2, 3
"""

_STARTED_SQL = """
SELECT date_bin('1 minute', created_at, %(epoch)s), count(*)
  FROM k2b_run
 WHERE status = ANY(%(statuses)s) AND created_at >= %(from)s AND created_at < %(until)s
 GROUP BY 1
"""

_STORED_SQL = """
SELECT minute, kind, status, error_code, count FROM k2b_overview_minute
 WHERE minute >= %(first)s AND minute < %(settled)s
"""

_ROLL_SQL = """
INSERT INTO k2b_overview_minute (minute, kind, status, error_code, count)
SELECT * FROM unnest(%s::timestamptz[], %s::text[], %s::text[], %s::text[], %s::bigint[])
    ON CONFLICT DO NOTHING
"""

#: The statements of the page, for the test that reads their plans.
STATEMENTS = {
    "active": _ACTIVE_SQL,
    "incidents": _INCIDENTS_SQL,
    "finished": _FINISHED_SQL,
    "started": _STARTED_SQL,
    "stored": _STORED_SQL,
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
    """The statements' parameters for ``window`` ending at ``now`` (the database's clock),
    with nothing rolled up yet: the live reads cover the whole window."""
    length, _ = WINDOWS[window]
    current = now.replace(second=0, microsecond=0)
    first = current - length + dt.timedelta(minutes=1)
    return {
        "cap": COUNT_CAP,
        "epoch": EPOCH,
        "first": first,
        "settled": current - SETTLE,
        "from": first,
        "until": current + dt.timedelta(minutes=1),
        "statuses": list(RunStatus.values),
    }


def read(window: str = "hour", using: str | None = None) -> Overview:
    """Read the overview of ``window`` ("hour" or "day") in a handful of bounded statements.

    Minutes over for ``SETTLE`` come from the rollup; those not in it yet, and
    the last few, from the runs table (and the former are added to the rollup).
    """
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {sorted(WINDOWS)}, not {window!r}")
    using = using or settings.database()
    length, _ = WINDOWS[window]
    minutes = int(length.total_seconds() // 60)
    with connections[using].cursor() as cursor:
        cursor.execute(_ACTIVE_SQL, {"cap": COUNT_CAP})
        now, queued, running, waiting, attention, due, oldest = cursor.fetchone()
        params = parameters(window, now)
        cursor.execute(_INCIDENTS_SQL, params)
        incidents = [(code or "-", n) for code, n in cursor.fetchall()]
        cursor.execute(_STORED_SQL, params)
        stored = cursor.fetchall()
        first, settled = params["first"], params["settled"]
        rolled = {minute for minute, kind, *_ in stored if kind == OverviewMinute.Kind.ROLLED}
        missing = [
            m
            for i in range(int((settled - first).total_seconds() // 60))
            if (m := first + dt.timedelta(minutes=i)) not in rolled
        ]
        live_from = missing[0] if missing else settled
        live = {**params, "from": live_from}
        cursor.execute(_FINISHED_SQL, live)
        finished_rows = cursor.fetchall()
        cursor.execute(_STARTED_SQL, live)
        started_rows = [(minute, "", "", n) for minute, n in cursor.fetchall()]
    if missing:
        _roll(using, set(missing), finished_rows, started_rows, now)
    for minute, kind, status, code, n in stored:
        if minute < live_from and kind == OverviewMinute.Kind.FINISHED:
            finished_rows.append((minute, status, code, n))
        elif minute < live_from and kind == OverviewMinute.Kind.STARTED:
            started_rows.append((minute, status, code, n))

    def minute_of(bucket: dt.datetime) -> int:
        return int((bucket - first).total_seconds() // 60)

    started = [0] * minutes
    for bucket, _, _, n in started_rows:
        minute = minute_of(bucket)
        if 0 <= minute < minutes:
            started[minute] += n
    finished_series = [0] * minutes
    failed_series = [0] * minutes
    finished: dict[str, int] = dict.fromkeys(FINISHED, 0)
    failing: dict[str, int] = {}
    failing_from = minutes - int(FAILING_WINDOW.total_seconds() // 60)
    for bucket, status, code, n in finished_rows:
        minute = minute_of(bucket)
        if status not in finished or not 0 <= minute < minutes:
            continue
        finished[status] += n
        finished_series[minute] += n
        if status == RunStatus.FAILED:
            failed_series[minute] += n
            if minute >= failing_from:
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


#: One process rolls the minutes at a time; the others skip the pass.
_ROLL_LOCK_SQL = "SELECT pg_try_advisory_xact_lock(%s)"

_PURGE_SQL = "DELETE FROM k2b_overview_minute WHERE minute < %s"


def _roll(
    using: str,
    missing: set[dt.datetime],
    finished_rows: list[tuple],
    started_rows: list[tuple],
    now: dt.datetime,
) -> None:
    """Store the counts of the ``missing`` minutes (read live just now) and mark them rolled.

    One page at a time (a transaction-level advisory lock; a page that does not
    get it only reads). A role that may not write here (a read-only replica)
    still gets its page: the failure is logged and the page reads live.
    """
    rows = [
        (minute, kind, status, code, n)
        for kind, source in (
            (OverviewMinute.Kind.FINISHED, finished_rows),
            (OverviewMinute.Kind.STARTED, started_rows),
        )
        for minute, status, code, n in source
        if minute in missing
    ]
    rows += [(minute, OverviewMinute.Kind.ROLLED, "", "", 0) for minute in sorted(missing)]
    columns = [list(column) for column in zip(*rows, strict=True)]
    try:
        with transaction.atomic(using=using), connections[using].cursor() as cursor:
            cursor.execute(_ROLL_LOCK_SQL, [_ROLL_LOCK])
            if not cursor.fetchone()[0]:
                return
            cursor.execute(_ROLL_SQL, columns)
            cursor.execute(_PURGE_SQL, [now - KEEP])
    except DatabaseError as exc:
        logger.warning("the overview's rollup was not written: %s", exc)
