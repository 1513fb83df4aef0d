"""The queues as an operator sees them: counts, the oldest ready run, throughput, pauses (#49).

The failure this is built around: a queues page that counts a table of a
million runs on every refresh (a peer's dashboard became unusable at 700,000
rows), so that the page an operator opens to pause a queue during an incident
is itself slow and loads the database. Every read here is bounded:

- the queues are found by skipping through ``k2b_run_queue_status`` from one
  name to the next (one index descent per queue, never a scan of the runs), at
  most ``MAX_QUEUES`` of them, with every paused queue;
- each queue's runs are counted per status through the same index, each count
  stopped at ``COUNT_CAP`` (shown "10,000+");
- the oldest ready run is the head of the queue's line (``k2b_run_queued_queue``,
  one row); what finished in the last ``RECENT`` is a range of the index.

Read by the admin's Queues page and by ``manage.py workflowqueues list``.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from django.db import connections

from . import settings
from .kernel import db, flow, pauses
from .models import QueuePause, RunStatus

#: Each status is counted up to this many runs per queue: beyond, "10,000+".
COUNT_CAP = 10_000
#: The most queues shown (the paused ones always are).
MAX_QUEUES = 200
#: Throughput is what finished over this last stretch.
RECENT = dt.timedelta(minutes=5)
STATUSES = tuple(RunStatus.values)

#: The queue names runs carry, in order, one index descent each (a "loose index scan").
_QUEUES_SQL = """
WITH RECURSIVE q(queue, n) AS (
    (SELECT queue, 1 FROM k2b_run ORDER BY queue LIMIT 1)
  UNION ALL
    SELECT (SELECT r.queue FROM k2b_run r WHERE r.queue > q.queue ORDER BY r.queue LIMIT 1),
           q.n + 1
      FROM q
     WHERE q.queue IS NOT NULL AND q.n < %s
)
SELECT queue FROM q WHERE queue IS NOT NULL
"""

_COUNT = (
    "(SELECT count(*) FROM (SELECT 1 FROM k2b_run r"
    " WHERE r.queue = q.name AND r.status = '{status}' LIMIT %(cap)s) c)"
)

#: Per queue, in one statement: its capped counts by status, how long the head of
#: its line has been due, and how many runs it finished in the last ``RECENT``.
_VIEW_SQL = f"""
SELECT q.name,
       {", ".join(_COUNT.format(status=s) for s in STATUSES)},
       (SELECT EXTRACT(EPOCH FROM k2b_now() - r.run_after) FROM k2b_run r
         WHERE r.queue = q.name AND r.status = 'queued' AND {flow.CLAIMABLE}
           AND {flow.LINE} <= k2b_now() AND r.run_after <= k2b_now()
         ORDER BY {flow.LINE} LIMIT 1),
       (SELECT count(*) FROM (SELECT 1 FROM k2b_run r
         WHERE r.queue = q.name AND r.status IN ('succeeded', 'failed', 'canceled')
           AND r.finished_at >= k2b_now() - %(recent_ms)s * interval '1 millisecond'
         LIMIT %(cap)s) c)
  FROM unnest(%(names)s::text[]) AS q(name)
"""

#: The statements of the page, for the test that reads their plans.
STATEMENTS = {"queues": _QUEUES_SQL, "view": _VIEW_SQL}


def shown(count: int) -> str:
    """A capped count as the page prints it: "10,000+" at the cap."""
    return f"{count:,}+" if count >= COUNT_CAP else f"{count:,}"


@dataclass(frozen=True)
class QueueView:
    """One queue: its runs per status (each up to ``COUNT_CAP``), its line, its pause."""

    name: str
    counts: dict[str, int]
    #: Seconds the run at the head of its line has been due; None: nothing is due.
    oldest_ready_s: float | None
    #: Runs that finished (succeeded, failed, canceled) in the last ``RECENT``.
    finished_recently: int
    pause: QueuePause | None

    @property
    def per_minute(self) -> float:
        return self.finished_recently / (RECENT.total_seconds() / 60)

    def shown_counts(self) -> list[tuple[str, str]]:
        return [(status, shown(self.counts[status])) for status in STATUSES]


def view_parameters(names: list[str]) -> dict[str, Any]:
    """The parameters of ``STATEMENTS["view"]`` for the queues ``names``."""
    return {"names": names, "cap": COUNT_CAP, "recent_ms": int(RECENT.total_seconds() * 1000)}


def queue_names(using: str | None = None, limit: int = MAX_QUEUES) -> list[str]:
    """The queues runs are in (up to ``limit``), by name: the runs list's filter (#51)."""
    with connections[using or settings.database()].cursor() as cursor:
        cursor.execute(_QUEUES_SQL, [limit])
        return [row[0] for row in cursor.fetchall()]


def read(using: str | None = None) -> list[QueueView]:
    """Every queue runs are in (up to ``MAX_QUEUES``) and every paused one, by name."""
    using = using or settings.database()
    with db.schema_required():
        paused = pauses.paused(using)
        names = sorted(set(queue_names(using)) | set(paused))
        with connections[using].cursor() as cursor:
            cursor.execute(_VIEW_SQL, view_parameters(names))
            rows = cursor.fetchall()
    return [_view(row, paused) for row in rows]


def _view(row: Any, paused: dict[str, QueuePause]) -> QueueView:
    name, *counts, oldest, finished = row
    return QueueView(
        name=name,
        counts=dict(zip(STATUSES, counts, strict=True)),
        oldest_ready_s=None if oldest is None else max(0.0, float(oldest)),
        finished_recently=finished,
        pause=paused.get(name),
    )
