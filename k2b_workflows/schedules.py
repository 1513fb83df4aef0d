"""``Schedule``: when a workflow starts by itself, and the arithmetic of its ticks.

The failure this module is built around: a schedule whose ticks are not one
well-defined sequence of instants. Two workers that disagree on the next tick
(one reads a cron expression in local time, the other in UTC; one fires 02:30
on a spring-forward night at 03:30, the other never) start a run twice or lose
one, and no lock can fix it. So every tick is a pure function of the spec and
an instant, computed here and nowhere else:

- ``cron`` ticks are the expression's matches in *local wall time* of
  ``timezone`` (parsed by cronsim), mapped to instants by one rule: a local
  time that does not exist (the hour skipped in spring) fires once, at the
  first valid instant after the gap; a local time that occurs twice (the hour
  repeated in autumn) fires once, at its first occurrence.
- ``every`` ticks are ``anchor + k * every`` (k >= 1), exactly ``every``
  apart in real time whatever the time zone does; the anchor is the moment
  the schedule was created (or its spec last changed), so the first tick
  comes after it.

Everything here is free of the database: the kernel's pass
(``kernel/schedule_passes.py``) feeds it the database's clock.
"""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
import re
from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from .exceptions import InvalidSchedule
from .validation import to_json_value

UTC = dt.UTC
_SECOND = dt.timedelta(seconds=1)
_MICROSECOND = dt.timedelta(microseconds=1)
#: Ticks looked at, at most, to find one: a cron expression matching only on
#: 29 February 2100 would otherwise iterate for ever.
_MAX_ITERATIONS = 100_000
#: The key ``scheduled_for`` the kernel adds to every scheduled run's input.
SCHEDULED_FOR = "scheduled_for"
#: The longest ``every`` and ``jitter``: ten years. Longer ones overflowed the
#: tick arithmetic (a datetime past year 9999) at the first save or pass (#35).
MAX_SPAN = dt.timedelta(days=3660)
#: The largest step (``*/N``) of each cron field, in order, seconds first: a
#: larger step matches only the field's first value, which is never what was meant.
_CRON_FIELDS = (
    ("second", 60),
    ("minute", 60),
    ("hour", 24),
    ("day of month", 31),
    ("month", 12),
    ("day of week", 7),
)


class CatchUp(enum.StrEnum):
    """What a schedule does with the ticks it missed (downtime, a pause)."""

    SKIP = "skip"  # start none of them
    LATEST = "latest"  # start one run, for the latest
    ALL = "all"  # start every one, in order (SCHEDULE_MAX_CATCH_UP per pass)


class Overlap(enum.StrEnum):
    """What a tick does while the schedule's previous run has not ended."""

    SKIP = "skip"  # start nothing (recorded)
    ALLOW = "allow"  # start it anyway
    BUFFER_ONE = "buffer_one"  # start it when the previous run ends; later ones are skipped


@dataclass(frozen=True)
class Schedule:
    """When a workflow starts by itself: a ``cron`` expression or a fixed interval ``every``.

    ``cron`` has 5 fields (minute hour day month weekday) or 6 with seconds
    first, read in ``timezone`` (an IANA name). ``every`` is a ``timedelta``
    of at least one second. ``input`` (a JSON object) is each run's input,
    plus ``"scheduled_for"``: the tick as UTC ISO 8601. ``jitter`` delays each
    tick by a fixed pseudo-random part of it (the same on every worker).
    Bad values raise ``InvalidSchedule`` naming the field.
    """

    cron: str | None = None
    _: KW_ONLY
    every: dt.timedelta | None = None
    timezone: str = "UTC"
    input: Any = None
    catch_up: str = CatchUp.LATEST
    overlap: str = Overlap.SKIP
    jitter: dt.timedelta | None = None

    def __post_init__(self) -> None:
        cron, every = self.cron, self.every
        if (cron is None or cron == "") == (every is None):
            got = "both" if every is not None else "neither"
            raise InvalidSchedule(
                f"a Schedule takes exactly one of cron= and every= (got {got})", field="cron"
            )
        if cron is not None and cron != "":
            object.__setattr__(self, "cron", parse_cron(cron))
        else:
            object.__setattr__(self, "cron", None)
            check_every(every)
        zone(self.timezone)
        if self.every is not None and self.timezone != "UTC":
            # Refused rather than ignored: ``every`` ticks are fixed real-time steps
            # from the anchor, and a zone there reads as a promise (ticks at local
            # midnight across DST) they do not keep. A cron expression does (#35).
            raise InvalidSchedule(
                f"Schedule timezone={self.timezone!r:.100} has no effect with every=: its ticks"
                " are exactly every apart in real time; use a cron expression for ticks at a"
                " local wall time, or leave timezone out",
                field="timezone",
            )
        object.__setattr__(self, "input", check_input(self.input))
        object.__setattr__(self, "catch_up", _choice(self.catch_up, CatchUp, "catch_up"))
        object.__setattr__(self, "overlap", _choice(self.overlap, Overlap, "overlap"))
        check_jitter(self.jitter)
        if self.every is not None and self.jitter is not None and self.jitter >= self.every:
            raise InvalidSchedule(
                f"Schedule jitter={self.jitter} is not shorter than every={self.every}: a tick"
                " would fire after the next one is due",
                field="jitter",
            )

    @classmethod
    def from_row(cls, row: Any) -> Schedule:
        """The spec a stored schedule row holds (a model or a raw row with the same fields).

        Raises ``InvalidSchedule`` for a row written around the validation.
        """
        return cls(
            row.cron or None,
            every=row.every,
            # A row stored before #35 may pair every with a zone, which was ignored.
            timezone=row.timezone if row.cron else "UTC",
            input=row.input,
            catch_up=row.catch_up,
            overlap=row.overlap,
            jitter=row.jitter,
        )

    # -- ticks ---------------------------------------------------------------

    def next_tick(self, after: dt.datetime, anchor: dt.datetime | None = None) -> dt.datetime:
        """The first tick strictly after ``after`` (aware); ``anchor``: see ``every``."""
        return next_tick(self.cron, self.every, self.timezone, after, anchor or after)

    def ticks(self, after: dt.datetime, anchor: dt.datetime | None = None) -> Iterator[dt.datetime]:
        """The ticks after ``after``, in order, for ever."""
        tick = after
        while True:
            tick = self.next_tick(tick, anchor or after)
            yield tick

    def describe(self) -> str:
        """One line an operator reads: ``cron 0 3 * * * (Europe/Berlin)`` or ``every 1:00:00``."""
        if self.cron:
            return f"cron {self.cron} ({self.timezone})"
        return f"every {self.every}"


def _choice(value: Any, kind: type[enum.StrEnum], field: str) -> str:
    try:
        return str(kind(value))
    except ValueError:
        allowed = ", ".join(repr(str(v)) for v in kind)
        raise InvalidSchedule(
            f"Schedule {field}={value!r:.100} is not one of {allowed}", field=field
        ) from None


def parse_cron(cron: Any) -> str:
    """``cron`` normalised (single spaces), or ``InvalidSchedule`` saying what is wrong."""
    if not isinstance(cron, str):
        raise InvalidSchedule(
            f"Schedule cron must be a string, not {type(cron).__name__}", field="cron"
        )
    fields = cron.split()
    if len(fields) not in (5, 6):
        raise InvalidSchedule(
            f"Schedule cron {cron!r:.200} has {len(fields)} fields: it takes 5 "
            "(minute hour day month weekday) or 6 (seconds first)",
            field="cron",
        )
    normalised = " ".join(fields)
    names = _CRON_FIELDS if len(fields) == 6 else _CRON_FIELDS[1:]
    for text, (name, largest) in zip(fields, names, strict=True):
        for step in re.findall(r"/(\d+)", text):
            if len(step) > 4 or int(step) > largest:
                raise InvalidSchedule(
                    f"Schedule cron {cron!r:.200}: the {name} step /{step:.30} is larger than"
                    f" {largest}: it would match only the first {name}",
                    field="cron",
                )
    try:
        CronSim(normalised, dt.datetime(2000, 1, 1))
    except CronSimError as exc:
        raise InvalidSchedule(
            f"Schedule cron {cron!r:.200} is invalid: {exc}", field="cron"
        ) from None
    return normalised


def check_every(every: Any) -> dt.timedelta:
    if not isinstance(every, dt.timedelta):
        raise InvalidSchedule(
            f"Schedule every must be a timedelta (e.g. timedelta(minutes=5)), not {every!r:.100}",
            field="every",
        )
    if every < _SECOND:
        raise InvalidSchedule(
            f"Schedule every={every} is under one second: ticks are at least 1 s apart",
            field="every",
        )
    if every > MAX_SPAN:
        raise InvalidSchedule(
            f"Schedule every={every} is longer than {MAX_SPAN.days} days", field="every"
        )
    return every


def check_jitter(jitter: Any) -> dt.timedelta | None:
    if jitter is None:
        return None
    if not isinstance(jitter, dt.timedelta) or jitter < dt.timedelta(0):
        raise InvalidSchedule(
            f"Schedule jitter must be a timedelta of zero or more, not {jitter!r:.100}",
            field="jitter",
        )
    if jitter > MAX_SPAN:
        raise InvalidSchedule(
            f"Schedule jitter={jitter} is longer than {MAX_SPAN.days} days", field="jitter"
        )
    return jitter


def check_input(value: Any) -> dict[str, Any]:
    """The schedule's input as stored: a JSON object without ``scheduled_for``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidSchedule(
            f"Schedule input must be a JSON object (a dict), not {type(value).__name__}",
            field="input",
        )
    try:
        stored = to_json_value(value, "the schedule input")
    except InvalidSchedule:
        raise
    except ValueError as exc:
        raise InvalidSchedule(f"Schedule input: {exc}", field="input") from None
    if SCHEDULED_FOR in stored:
        raise InvalidSchedule(
            f"Schedule input must not hold {SCHEDULED_FOR!r}: each run gets its tick there",
            field="input",
        )
    return dict(stored)


def zone(name: Any) -> ZoneInfo:
    """The ``ZoneInfo`` of ``name``, or ``InvalidSchedule`` naming the field ``timezone``."""
    if not isinstance(name, str) or not name:
        raise InvalidSchedule(
            f"Schedule timezone must be an IANA time zone name, not {name!r:.100}",
            field="timezone",
        )
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidSchedule(
            f"Schedule timezone {name!r:.100} is not a known time zone "
            "(an IANA name such as 'Europe/Berlin' or 'UTC')",
            field="timezone",
        ) from None


# -- tick arithmetic ---------------------------------------------------------


def next_tick(
    cron: str | None,
    every: dt.timedelta | None,
    timezone: str,
    after: dt.datetime,
    anchor: dt.datetime,
) -> dt.datetime:
    """The first tick strictly after ``after``, in UTC."""
    if every is not None:
        if after < anchor:
            return anchor + every
        periods = (after - anchor) // every
        return anchor + (periods + 1) * every
    assert cron is not None
    tz = zone(timezone)
    local = after.astimezone(tz).replace(tzinfo=None)
    for count, candidate in enumerate(CronSim(cron, local)):
        instant = local_to_instant(candidate, tz)
        if instant > after:
            return instant
        if count > _MAX_ITERATIONS:
            break
    raise InvalidSchedule(f"cron {cron!r} has no tick after {after.isoformat()}", field="cron")


def local_to_instant(local: dt.datetime, tz: ZoneInfo) -> dt.datetime:
    """The instant (UTC) a naive local wall time fires at, under the DST rule.

    A time that exists once is itself; one that occurs twice is its first
    occurrence (``fold=0``); one that does not exist is the first valid
    instant after the gap (the transition), so 02:30 on a spring-forward
    night fires at 03:00 and merges with a 03:00 tick.
    """
    first = local.replace(tzinfo=tz, fold=0).astimezone(UTC)
    if first.astimezone(tz).replace(tzinfo=None) == local:
        return first
    # In the gap: fold=0 reads it with the offset before the transition (an
    # instant after it), fold=1 with the one after (an instant before it).
    lo = int(local.replace(tzinfo=tz, fold=1).astimezone(UTC).timestamp())
    hi = int(first.timestamp()) + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        wall = dt.datetime.fromtimestamp(mid, UTC).astimezone(tz).replace(tzinfo=None)
        if wall > local:
            hi = mid
        else:
            lo = mid
    return dt.datetime.fromtimestamp(hi, UTC)


def jitter_for(schedule_id: str, tick: dt.datetime, jitter: dt.timedelta | None) -> dt.timedelta:
    """The delay of ``tick``: a fixed part of ``jitter`` every worker computes alike."""
    if not jitter:
        return dt.timedelta(0)
    span = int(jitter / _MICROSECOND)
    if span <= 0:
        return dt.timedelta(0)
    digest = hashlib.sha256(f"{schedule_id}\n{iso(tick)}".encode()).digest()
    return dt.timedelta(microseconds=int.from_bytes(digest[:8], "big") % span)


def iso(tick: dt.datetime) -> str:
    """A tick as the run's key and input hold it: UTC ISO 8601 (``2027-03-28T01:00:00+00:00``)."""
    return tick.astimezone(UTC).isoformat()


def idempotency_key(schedule_id: str, tick: dt.datetime) -> str:
    """``schedule:<schedule_id>:<tick>``: the run of one tick exists once, whoever inserts it."""
    return f"schedule:{schedule_id}:{iso(tick)}"
