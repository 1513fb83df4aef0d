"""Schedule passes: every worker fires due ticks, and each tick starts one run, once.

The failure this module guards against: a tick fired twice or lost across a
fleet. There is no beat process to be the single scheduler (Celery beat's
"run exactly one, or get duplicates"): every ``runworkflows`` runs passes, on
any number of hosts, and any of them may be SIGKILLed mid-pass or lose its
database to a restart. What keeps one run per tick:

- A pass is one transaction on the database's clock (``k2b_now()``, never
  a host's): it locks the due schedule rows ``FOR UPDATE SKIP LOCKED``,
  oldest next tick first, decides each row's due ticks, inserts their runs
  and moves the row's next tick on. The runs and the row's new state commit
  together or not at all: a pass killed before its commit fired nothing and
  leaves the row due for the next pass, on any worker; a commit lost with
  the connection is either in (the row moved on) or not (it is due again).
- Two passes never work on one row at once: the second skips the locked
  row, and one that reads it after the first committed (READ COMMITTED
  re-checks ``next_fire_at <= k2b_now()`` on the new row version) finds its
  next tick in the future.
- The backstop: a tick's run has ``idempotency_key =
  "schedule:<schedule_id>:<tick UTC ISO 8601>"``, unique per workflow. A pass
  working from a rewound row (a restored backup, a hand edit) finds the run
  it would insert already there and starts nothing.

Passes are cheap when nothing is due: a worker asks the partial index
``k2b_schedule_due`` when the next tick fires (one indexed read, at most once
per ``SCHEDULE_PASS_INTERVAL_MS``) and opens a pass only then; claiming runs
never waits for it. Tick arithmetic (cron in local time, DST, ``every``) is
``k2b_workflows/schedules.py``; the catch-up and overlap policies are here.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction

from .. import counters, settings
from ..exceptions import (
    DatabaseNotMigrated,
    DatabaseUnavailable,
    IdempotencyConflict,
    InvalidInput,
    WorkflowError,
)
from ..models import WorkflowScheduleSkip
from ..schedules import SCHEDULED_FOR, CatchUp, Overlap, Schedule, idempotency_key, iso, jitter_for
from ..validation import to_json_value
from ..workflows import get_workflow
from . import db, schedule_seals, starts

logger = logging.getLogger(__name__)

#: Rows one pass locks; a pass that finds more due runs again at once.
ROWS_PER_PASS = 100
#: Missed ticks counted one by one, at most, for the skip record of a long downtime.
_COUNT_CAP = 10_000
_MICROSECOND = dt.timedelta(microseconds=1)
#: Why a tick started no run (``WorkflowScheduleSkip.reason``).
CATCH_UP, OVERLAP, BUFFER_FULL = "catch_up", "overlap", "buffer_full"

#: Seconds until the next tick fires (<= 0: due now; NULL: no schedule), and
#: whether a buffered tick's previous run has ended. Both read partial indexes.
PROBE_SQL = """
SELECT EXTRACT(EPOCH FROM (
           SELECT min(next_fire_at) FROM k2b_schedule
            WHERE enabled AND NOT paused AND workflow_name = ANY(%s)) - k2b_now()),
       EXISTS (SELECT 1 FROM k2b_schedule s
                WHERE s.enabled AND NOT s.paused AND s.buffered_tick IS NOT NULL
                  AND s.workflow_name = ANY(%s)
                  AND NOT EXISTS (SELECT 1 FROM k2b_run r
                                   WHERE r.schedule_id = s.schedule_id
                                     AND r.status IN ('queued', 'running', 'waiting',
                                                      'needs_attention')))
"""

_COLUMNS = (
    "id, schedule_id, workflow_name, workflow_version, cron, every, timezone, input, catch_up,"
    " overlap, jitter, anchor, next_tick, last_tick, buffered_tick, resumed_at,"
    " paused, enabled, next_fire_at, seal"
)
DUE_SQL = f"""
SELECT {_COLUMNS}, k2b_now() FROM k2b_schedule
 WHERE enabled AND NOT paused AND workflow_name = ANY(%s) AND next_fire_at <= k2b_now()
 ORDER BY next_fire_at
 LIMIT %s
 FOR UPDATE SKIP LOCKED
"""
BUFFERED_SQL = f"""
SELECT {_COLUMNS}, k2b_now() FROM k2b_schedule
 WHERE enabled AND NOT paused AND workflow_name = ANY(%s) AND buffered_tick IS NOT NULL
 ORDER BY buffered_tick
 LIMIT %s
 FOR UPDATE SKIP LOCKED
"""
ACTIVE_SQL = """
SELECT EXISTS (SELECT 1 FROM k2b_run WHERE schedule_id = %s
                  AND status IN ('queued', 'running', 'waiting', 'needs_attention'))
"""
ADVANCE_SQL = """
UPDATE k2b_schedule
   SET next_tick = %s, next_fire_at = %s, last_tick = %s,
       last_run_id = COALESCE(%s, last_run_id), buffered_tick = %s, seal = %s,
       updated_at = k2b_now()
 WHERE id = %s
"""
#: The pass disables a row it cannot fire: sealed again (the key holder decided),
#: or, for a row that failed its seal, left with the broken one (``seal`` NULL: kept).
DISABLE_SQL = """
UPDATE k2b_schedule SET enabled = false, disabled_reason = %s, seal = COALESCE(%s, seal),
       updated_at = k2b_now()
 WHERE id = %s
"""
#: Schedules a pass should have fired a while ago: none of the fleet's workers
#: runs passes for them (all ``--no-schedules``, none has the workflow) or they lag.
LATE_SQL = """
SELECT schedule_id, workflow_name, next_fire_at,
       EXTRACT(EPOCH FROM (k2b_now() - next_fire_at)), COALESCE(input->>'task', '')
  FROM k2b_schedule
 WHERE enabled AND NOT paused AND next_fire_at < k2b_now() - %s * interval '1 millisecond'
 ORDER BY next_fire_at
"""


@dataclass
class PassResult:
    """What one pass did, for the worker's stats and the tests."""

    rows: int = 0
    started: int = 0
    #: Rows refused (and disabled) for a seal that does not match.
    tampered: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    lags: list[float] = field(default_factory=list)


@dataclass
class _Row:
    id: int
    schedule_id: str
    workflow_name: str
    workflow_version: int | None
    cron: str
    every: dt.timedelta | None
    timezone: str
    input: Any
    catch_up: str
    overlap: str
    jitter: dt.timedelta | None
    anchor: dt.datetime
    next_tick: dt.datetime | None
    last_tick: dt.datetime | None
    buffered_tick: dt.datetime | None
    resumed_at: dt.datetime | None
    paused: bool
    enabled: bool
    next_fire_at: dt.datetime | None
    seal: str

    def sealed(self, **changes: Any) -> str:
        """The seal of this row with ``changes`` written: the pass holds the key."""
        return schedule_seals.seal({**schedule_seals.of_row(self), **changes})

    def fire_at(self, tick: dt.datetime) -> dt.datetime:
        return tick + jitter_for(self.schedule_id, tick, self.jitter)


def probe(using: str, names: list[str]) -> tuple[float | None, bool]:
    """(seconds until the next tick of ``names`` fires or None, a buffered tick may start)."""
    rows = db.fetchall(using, PROBE_SQL, [names, names])
    due_in, buffered = rows[0]
    return (None if due_in is None else float(due_in)), bool(buffered)


def run_pass(
    using: str,
    versions: dict[str, set[int]],
    *,
    buffered: bool = False,
) -> PassResult:
    """Fire the due ticks of the schedules of ``versions`` (name -> registered versions).

    One transaction; see the module docstring. ``buffered``: look at the rows
    holding a buffered tick too (the probe said one may start).
    """
    result = PassResult()
    names = sorted(versions)
    if not names:
        return result
    with transaction.atomic(using=using):
        rows = db.fetchall(using, DUE_SQL, [names, ROWS_PER_PASS])
        if buffered:
            seen = {r[0] for r in rows}
            rows += [
                r
                for r in db.fetchall(using, BUFFERED_SQL, [names, ROWS_PER_PASS])
                if r[0] not in seen
            ]
        skips: list[WorkflowScheduleSkip] = []
        for values in rows:
            row, now = _Row(*values[:-1]), values[-1]
            row.input = db.from_json(row.input)
            tampered = schedule_seals.problem(schedule_seals.of_row(row), row.seal)
            if tampered is not None:
                # Written without the evidence key (the runtime role's INSERT or UPDATE):
                # firing it would seal a stranger's run with the key. Disabled, not
                # resealed: it stays broken for verifyworkflows and the admin.
                logger.error(
                    "schedule %s was not written by the key holder and was disabled,"
                    " nothing started: %s",
                    row.schedule_id,
                    tampered,
                )
                reason = f"{schedule_seals.TAMPERED}: {tampered}"
                db.execute(using, DISABLE_SQL, [reason[:300], None, row.id])
                result.tampered += 1
                continue
            if row.workflow_version is not None and row.workflow_version not in versions.get(
                row.workflow_name, set()
            ):
                continue  # a worker that has that version fires it
            result.rows += 1
            counted = (result.started, dict(result.skipped), len(result.lags), len(skips))
            try:
                # A savepoint per row: a row that cannot fire (an input grown past
                # MAX_VALUE_BYTES, a workflow gone) must not hold back the others.
                with transaction.atomic(using=using):
                    _fire(using, row, now, result, skips)
            except (DatabaseNotMigrated, DatabaseUnavailable):
                raise  # the database's state, not the row's
            except WorkflowError as exc:
                # Its savepoint rolled back: so does what was counted for it.
                result.started, result.skipped = counted[0], counted[1]
                del result.lags[counted[2] :], skips[counted[3] :]
                logger.error("schedule %s cannot fire and was disabled: %s", row.schedule_id, exc)
                db.execute(
                    using,
                    DISABLE_SQL,
                    [f"cannot fire: {exc}"[:300], row.sealed(enabled=False), row.id],
                )
        if skips:
            WorkflowScheduleSkip.objects.using(using).bulk_create(skips)
    for reason, n in result.skipped.items():
        counters.count_schedule_skips(reason, n)
    for lag in result.lags:
        counters.observe_schedule_lag(lag)
    return result


def _fire(
    using: str,
    row: _Row,
    now: dt.datetime,
    result: PassResult,
    skips: list[WorkflowScheduleSkip],
) -> None:
    """Decide one locked row's due ticks, start their runs and move the row on."""
    try:
        spec = Schedule.from_row(row)
    except InvalidInput as exc:
        # Written around the validation (raw SQL, a restored dump): firing it would
        # guess. Disabled with the reason on its admin page, never silently run.
        logger.error("schedule %s is invalid and was disabled: %s", row.schedule_id, exc)
        db.execute(using, DISABLE_SQL, [f"invalid: {exc}"[:300], row.sealed(enabled=False), row.id])
        return
    plan = _Plan(row, spec, now)
    last_started: tuple[dt.datetime, Any] | None = None
    active: bool | None = None

    def is_active() -> bool:
        nonlocal active
        if active is None:
            active = bool(db.fetchall(using, ACTIVE_SQL, [row.schedule_id])[0][0])
        return active

    def fire(tick: dt.datetime) -> None:
        nonlocal active, last_started
        try:
            run_id = starts.start(
                using,
                get_workflow(row.workflow_name, row.workflow_version),
                to_json_value({**spec.input, SCHEDULED_FOR: iso(tick)}, "the schedule's input"),
                idempotency_key=idempotency_key(row.schedule_id, tick),
                schedule_id=row.schedule_id,
                scheduled_for=tick,
            ).pk
        except IdempotencyConflict as exc:
            # The tick's run exists, started with another input (the input was edited
            # after a restored row made the tick due again): it ran; nothing to start.
            logger.warning(
                "schedule %s: tick %s already has run %s", row.schedule_id, iso(tick), exc.run_id
            )
            return
        active = True
        last_started = (tick, run_id)
        result.started += 1
        result.lags.append(max((now - row.fire_at(tick)).total_seconds(), 0.0))

    buffered = row.buffered_tick
    if buffered is not None and not is_active():
        fire(buffered)
        buffered = None
    for tick in plan.to_fire():
        if spec.overlap == Overlap.ALLOW or not is_active():
            fire(tick)
        elif spec.overlap == Overlap.BUFFER_ONE and buffered is None:
            buffered = tick
        elif spec.overlap == Overlap.BUFFER_ONE:
            plan.skip(tick, BUFFER_FULL)
        else:
            plan.skip(tick, OVERLAP)
    for reason, (first, last, count) in plan.skipped:
        skips.append(
            WorkflowScheduleSkip(
                schedule_id=row.id,
                first_tick=first,
                last_tick=last,
                count=count,
                reason=reason,
                recorded_at=now,
            )
        )
        result.skipped[reason] = result.skipped.get(reason, 0) + count
    next_tick = plan.next_tick
    moved = {
        "next_tick": next_tick,
        "next_fire_at": row.fire_at(next_tick),
        "last_tick": last_started[0] if last_started else row.last_tick,
        "buffered_tick": buffered,
    }
    db.execute(
        using,
        ADVANCE_SQL,
        [
            moved["next_tick"],
            moved["next_fire_at"],
            moved["last_tick"],
            last_started[1] if last_started else None,
            buffered,
            row.sealed(**moved),
            row.id,
        ],
    )


class _Plan:
    """One row's due ticks under its ``catch_up`` policy: which fire, which are skipped.

    Of the due ticks only the latest can be current; every earlier one is
    *missed* (the fleet was down, or a pass came late), and so is the latest
    itself when a pass sees it more than ``SCHEDULE_MISSED_AFTER_MS`` after it
    was due, or when it fell before the last resume (the schedule was paused).
    A current tick fires; of the missed ones ``skip`` fires none, ``latest``
    the latest, ``all`` every one in order (``SCHEDULE_MAX_CATCH_UP`` per pass).
    """

    def __init__(self, row: _Row, spec: Schedule, now: dt.datetime) -> None:
        self.row = row
        self.spec = spec
        self.now = now
        self.next_tick = row.next_tick or spec.next_tick(now, row.anchor)
        self.skipped: list[tuple[str, tuple[dt.datetime, dt.datetime, int]]] = []

    def _after(self, tick: dt.datetime) -> dt.datetime:
        return self.spec.next_tick(tick, self.row.anchor)

    def skip(
        self, tick: dt.datetime, reason: str, last: dt.datetime | None = None, n: int = 1
    ) -> None:
        """Record skipped ticks, merged with the previous record of the same reason."""
        if self.skipped and self.skipped[-1][0] == reason:
            first, _, count = self.skipped[-1][1]
            self.skipped[-1] = (reason, (first, last or tick, count + n))
        else:
            self.skipped.append((reason, (tick, last or tick, n)))

    def to_fire(self) -> list[dt.datetime]:
        row, now, first = self.row, self.now, self.next_tick
        if row.fire_at(first) > now:
            return []
        if self.spec.catch_up == CatchUp.ALL:
            due: list[dt.datetime] = []
            tick = first
            while row.fire_at(tick) <= now and len(due) < settings.schedule_max_catch_up():
                due.append(tick)
                tick = self._after(tick)
            self.next_tick = tick
            return due
        latest = self._latest_due(first)
        self.next_tick = self._after(latest)
        current_missed = now - row.fire_at(latest) > settings.schedule_missed_after() or (
            row.resumed_at is not None and latest <= row.resumed_at
        )
        fire = [] if current_missed else [latest]
        missed_until = self.next_tick if current_missed else latest
        if first < missed_until:
            count, last = self._span(first, missed_until)
            if self.spec.catch_up == CatchUp.LATEST:
                fire.insert(0, last)
                if count > 1:
                    self.skip(first, CATCH_UP, self._last_before(last, first), count - 1)
            else:
                self.skip(first, CATCH_UP, last, count)
        return fire

    def _latest_due(self, first: dt.datetime) -> dt.datetime:
        """The last tick from ``first`` on whose fire time has passed (``first``'s has)."""
        row, now = self.row, self.now
        # Ticks up to now - jitter are due whatever their jitter: jump there, then walk.
        surely = now - (row.jitter or dt.timedelta(0))
        tick = first
        if self._after(first) <= surely:
            tick = self._last_before(surely + _MICROSECOND, first)
        while row.fire_at(following := self._after(tick)) <= now:
            tick = following
        return tick

    def _span(self, start: dt.datetime, stop: dt.datetime) -> tuple[int, dt.datetime]:
        """How many ticks lie in [start, stop), and the last of them (start is one)."""
        every = self.spec.every
        if every is not None:
            count = max(round((stop - start) / every), 1)
            return count, start + (count - 1) * every
        count, last, tick = 0, start, start
        while tick < stop:
            count, last = count + 1, tick
            if count >= _COUNT_CAP:
                return count, self._last_before(stop, tick)
            tick = self._after(tick)
        return count, last

    def _last_before(self, stop: dt.datetime, not_before: dt.datetime) -> dt.datetime:
        """The last tick before ``stop`` and not before ``not_before`` (a tick before ``stop``)."""
        reach = dt.timedelta(minutes=1)
        while True:
            probe_from = max(stop - reach, not_before - _MICROSECOND)
            tick = self._after(probe_from)
            if tick < stop:
                while (following := self._after(tick)) < stop:
                    tick = following
                return tick
            if probe_from <= not_before:
                return not_before
            reach *= 8


#: How many schedules are late (the scrape's gauge; a cursor of its own connection).
LATE_COUNT_SQL = """
SELECT count(*) FROM k2b_schedule
 WHERE enabled AND NOT paused AND next_fire_at < k2b_now() - %s * interval '1 millisecond'
"""


def late_count(cursor: Any) -> int:
    """Late schedules, read through ``cursor`` (Django's or a raw psycopg one)."""
    cursor.execute(LATE_COUNT_SQL, [settings.schedule_missed_after_ms()])
    return int(cursor.fetchone()[0])


def late(using: str) -> list[tuple[str, str, dt.datetime, float, str]]:
    """(schedule id, workflow, when it was due, seconds late, task path) of every late
    schedule; the task path of a task's schedule ("" otherwise) is what it is known by."""
    return [
        (r[0], r[1], r[2], float(r[3]), r[4])
        for r in db.fetchall(using, LATE_SQL, [settings.schedule_missed_after_ms()])
    ]


def preview(spec: Schedule, after: dt.datetime, count: int = 5) -> list[dt.datetime]:
    """The next ``count`` ticks of ``spec`` after ``after`` (every: anchored at ``after``)."""
    ticks = spec.ticks(after, after)
    return [next(ticks) for _ in range(count)]
