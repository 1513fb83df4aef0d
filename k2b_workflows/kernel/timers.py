"""Durable timers: ``run.sleep(timedelta)`` and ``run.sleep_until(datetime)`` in workflow code.

The failure this is built around: ``time.sleep`` in a workflow holds a worker
thread for the whole wait and starts the wait again after every crash or
replay (an hour's sleep, killed at minute 59, sleeps another hour). A timer
here is a step: the first time the run reaches it, the wake-up instant is
computed once and the run *parks* on a wait of its own (``waits.park``,
kind ``k2b.timer``) whose deadline is that instant, with no thread held. The
instant is kept in the wait's key on the run row, so a replay before the
deadline parks again until the same instant, never a new one. When the
deadline passes the run is re-queued like any wait (``claim.py``), replays
to the timer, finds the instant passed and journals the step: every later
replay returns at once without sleeping.

Time is the kernel's (``clock.now()`` and the deadline compared by
``k2b_now()``): under ``controlled_clock()`` a day's sleep passes with
``clock.advance(days=1)``.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from django.utils import timezone

from ..actions import Action, Dependency, Effect, Succeeded
from ..exceptions import InvalidInput
from . import clock, evidence

if TYPE_CHECKING:
    from ..models import JournalEntry, WorkflowRun
    from .journal import RunJournal, Step


class Execution(Protocol):
    """What a timer asks of the execution it is a step of (``execute.Execution``): a
    protocol, so that the kernel's steps never import the executor."""

    run_id: uuid.UUID
    run: WorkflowRun
    journal: RunJournal

    def begin_marker(self) -> int: ...

    def replay_marker(self, entry: JournalEntry, name: str, input: Any, input_hash: str) -> Any: ...

    def marker_step(
        self, seq: int, action: Action, name: str, input: Any, input_hash: str
    ) -> Step: ...

    def journal_marker(self, step: Step, result: Succeeded) -> Any: ...

    def park_marker(self, seq: int, name: str, dependency: Any) -> NoReturn: ...


#: The wait kind of a timer, and the journal's action name for it.
TIMER_KIND = "k2b.timer"
#: The longest sleep accepted: a wait deadline far beyond any deploy's lifetime is a bug.
MAX_SLEEP = dt.timedelta(days=3660)


class SleepAction(Action):
    """What the journal records for a timer step."""

    name = TIMER_KIND
    effect = Effect.PURE


def check_duration(duration: Any) -> dt.timedelta:
    if not isinstance(duration, dt.timedelta):
        raise InvalidInput(f"run.sleep() takes a timedelta, not {duration!r:.80}")
    if duration <= dt.timedelta(0):
        raise InvalidInput(f"run.sleep() duration must be positive, not {duration}")
    if duration > MAX_SLEEP:
        raise InvalidInput(f"run.sleep() duration must be at most {MAX_SLEEP.days} days")
    return duration


def check_instant(when: Any) -> dt.datetime:
    if not isinstance(when, dt.datetime):
        raise InvalidInput(f"run.sleep_until() takes a datetime, not {when!r:.80}")
    if timezone.is_naive(when):
        raise InvalidInput(
            f"run.sleep_until() needs an aware datetime (with a time zone), not the naive {when}"
        )
    return when


def _key(execution: Execution, seq: int, until: dt.datetime) -> str:
    return f"{execution.run_id}:{seq}:{until.astimezone(dt.UTC).isoformat()}"


def _parked_until(execution: Execution, seq: int) -> dt.datetime | None:
    """The instant this timer parked for on an earlier claim, read from the run row."""
    run = execution.run
    if run.wait_kind != TIMER_KIND or run.wait_step != seq:
        return None
    prefix = f"{execution.run_id}:{seq}:"
    if not run.wait_key.startswith(prefix):
        return None
    return dt.datetime.fromisoformat(run.wait_key[len(prefix) :])


def sleep(execution: Execution, *, duration: dt.timedelta | None = None, until: Any = None) -> None:
    """The timer step at the run's next position: journaled, or parked until due."""
    if duration is not None:
        duration = check_duration(duration)
        asked: dict[str, Any] = {"sleep_seconds": duration.total_seconds()}
    else:
        until = check_instant(until)
        asked = {"sleep_until": until.astimezone(dt.UTC).isoformat()}
    seq = execution.begin_marker()
    input_hash = evidence.hash_value(asked)
    entry = execution.journal.get(seq)
    if entry is not None:
        execution.replay_marker(entry, TIMER_KIND, asked, input_hash)
        return
    wake_at = _parked_until(execution, seq)
    if wake_at is None:
        wake_at = clock.now() + duration if duration is not None else until
    if clock.now() >= wake_at:
        step = execution.marker_step(seq, SleepAction(), TIMER_KIND, asked, input_hash)
        until_text = wake_at.astimezone(dt.UTC).isoformat()
        execution.journal_marker(
            step, Succeeded({"until": until_text}, f"slept until {until_text}")
        )
        return
    execution.park_marker(
        seq, TIMER_KIND, Dependency(TIMER_KIND, _key(execution, seq, wake_at), wake_at)
    )
