"""Writing a running step's progress: on a thread and a connection of its own, throttled.

The failures this is built around:

- progress written in the step's transaction: a step that rolls back takes
  its progress with it, and nobody else sees a value until the step commits.
  Here every value is written by the writer thread on its own autocommit
  connection, each upsert a transaction of its own, never the step's: the
  step's connection is never touched, whatever it holds open;
- a loop that reports every item (thousands of calls a second) writing every
  call: at most one write per run every ``MIN_INTERVAL_S`` here, the values
  in between coalesced into the next. The last value is never lost to the
  throttle: the writer writes it when its interval has passed (within a
  second, while the step still runs), and the step's end (``Running``)
  writes what is pending at once and waits for it, so that a caller who
  sees the run end reads its final progress;
- a stale execution (its lease taken over) overwriting the new one's bar:
  the upsert keeps the row of a higher generation.

``set_progress`` only hands the value over (no I/O on the caller's thread, so
an async task's loop never blocks on it). Progress is display: nothing a
worker decides reads it, and a write that fails is logged, retried a few
times, then dropped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import db

logger = logging.getLogger(__name__)

#: A run's progress is written at most once per this interval (the last value after it).
MIN_INTERVAL_S = 0.25
#: How long a step's end waits for its last value to be written.
FINAL_WAIT_S = 2.0
#: The writer's connections are closed after this long with nothing to write.
IDLE_CLOSE_S = 1.0
#: A value whose write failed this many times is dropped (logged).
MAX_TRIES = 3
#: The last write of a run never written: long enough ago, whatever the clock's origin.
_NEVER = float("-inf")

#: One row per run; a stale generation never overwrites a newer one's.
_UPSERT_SQL = """
INSERT INTO k2b_progress AS p (run_id, generation, done, total, note, updated_at)
VALUES (%s, %s, %s, %s, %s, %s)
ON CONFLICT (run_id) DO UPDATE
   SET generation = EXCLUDED.generation, done = EXCLUDED.done, total = EXCLUDED.total,
       note = EXCLUDED.note, updated_at = EXCLUDED.updated_at
 WHERE p.generation <= EXCLUDED.generation
"""


@dataclass
class Value:
    """One value to write for a run."""

    using: str
    run_id: str
    generation: int
    done: int
    total: int | None
    note: str
    at: Any
    tries: int = 0

    def parameters(self) -> list[Any]:
        return [self.run_id, self.generation, self.done, self.total, self.note, self.at]


class Writer:
    """The process's progress writer: a daemon thread, started on the first value."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[str, Value] = {}
        #: Runs whose pending value must be written now (a step ended), throttle or not.
        self._urgent: set[str] = set()
        self._writing: set[str] = set()
        #: run id -> ``time.monotonic()`` of its last write, for the throttle.
        self._last: dict[str, float] = {}
        self._conns: dict[str, Any] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        #: Statements sent, for tests that count what the throttle let through.
        self.writes = 0

    def put(self, value: Value) -> None:
        """Hand ``value`` over; it replaces a value of its run not yet written."""
        with self._cond:
            self._pending[value.run_id] = value
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="k2b-progress", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def has_pending(self, run_id: str) -> bool:
        # Read without the lock: a step that never reported pays two dict look-ups.
        return run_id in self._pending or run_id in self._writing

    def flush(self, run_id: str | None = None, timeout: float = FINAL_WAIT_S) -> bool:
        """Write ``run_id``'s pending value (every run's: None) now; wait until written.

        Returns False if it was not written within ``timeout`` (it still will be).
        """
        with self._cond:
            keys = set(self._pending) if run_id is None else {run_id} & set(self._pending)
            self._urgent |= keys
            self._cond.notify_all()

            def written() -> bool:
                if run_id is None:
                    return not self._pending and not self._writing
                return run_id not in self._pending and run_id not in self._writing

            return self._cond.wait_for(written, timeout)

    def stop(self, timeout: float = FINAL_WAIT_S) -> None:
        """Write everything pending, close the connections and end the thread."""
        self.flush(None, timeout)
        with self._cond:
            self._stopping = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            for value in batch:
                self._write(value)
            with self._cond:
                self._writing.clear()
                self._cond.notify_all()

    def _next_batch(self) -> list[Value] | None:
        """The values due now (their run's interval has passed, or urgent); None: stop."""
        idle_since = time.monotonic()
        with self._cond:
            while True:
                now = time.monotonic()
                due = [
                    key
                    for key in self._pending
                    if key in self._urgent or now >= self._last.get(key, _NEVER) + MIN_INTERVAL_S
                ]
                if due:
                    self._urgent.difference_update(due)
                    self._writing.update(due)
                    self._forget_old(now)
                    return [self._pending.pop(key) for key in due]
                if self._stopping and not self._pending:
                    self._close()
                    return None
                timeout: float | None = None
                if self._pending:
                    first = min(self._last.get(k, _NEVER) for k in self._pending)
                    timeout = max(first + MIN_INTERVAL_S - now, 0.001)
                elif self._conns:
                    if now - idle_since >= IDLE_CLOSE_S:
                        # An idle connection would outlive the database it points to.
                        self._close()
                    else:
                        timeout = idle_since + IDLE_CLOSE_S - now
                self._cond.wait(timeout)

    def _forget_old(self, now: float) -> None:
        """Drop throttle stamps that no longer throttle: the map stays as small as the
        runs reporting in the last interval."""
        if len(self._last) > 1000:
            self._last = {k: t for k, t in self._last.items() if now - t < MIN_INTERVAL_S}

    def _write(self, value: Value) -> None:
        try:
            conn = self._conns.get(value.using)
            if conn is None:
                # Nothing of the session is relied on (no setting, no prepared
                # statement): through a transaction pooler the next write may reach
                # another server connection. A write that waits on a lock costs a
                # step's end at most ``FINAL_WAIT_S``.
                conn = db.autocommit_connection(value.using, follow_clock=False)
                conn.prepare_threshold = None
                self._conns[value.using] = conn
            self.writes += 1
            conn.execute(_UPSERT_SQL, value.parameters())
        except Exception as exc:
            self._drop(value.using)
            value.tries += 1
            if value.tries >= MAX_TRIES:
                logger.error(
                    "run %s: its progress %s/%s was not written: %s",
                    value.run_id,
                    value.done,
                    value.total,
                    exc,
                )
            else:
                logger.warning("run %s: progress not written, tried again: %s", value.run_id, exc)
                with self._cond:
                    self._pending.setdefault(value.run_id, value)
        finally:
            self._last[value.run_id] = time.monotonic()

    def _drop(self, using: str) -> None:
        conn = self._conns.pop(using, None)
        if conn is not None:
            with contextlib.suppress(Exception):  # already broken: nothing to release
                conn.close()

    def _close(self) -> None:
        for using in list(self._conns):
            self._drop(using)


writer = Writer()


def _after_fork() -> None:
    """A forked child has no writer thread, and its lock may have been held at the fork."""
    global writer
    writer = Writer()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


# -- which steps are running in this process -----------------------------------------

#: run id -> the step context of its step running in this process.
_live: dict[str, Any] = {}


def live_step(run_id: Any) -> Any:
    """The context of ``run_id``'s step running in this process, or None."""
    return _live.get(str(run_id))


def is_live(ctx: Any) -> bool:
    """Whether ``ctx`` is the context of a step running in this process now."""
    return _live.get(str(ctx.run_id)) is ctx


class Running:
    """While a step's hooks run: its context takes progress; at its end, the last value
    is written before the step's own end can commit."""

    __slots__ = ("ctx", "key")

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.key = str(ctx.run_id)

    def __enter__(self) -> None:
        _live[self.key] = self.ctx

    def __exit__(self, *exc: object) -> None:
        if _live.get(self.key) is self.ctx:
            del _live[self.key]
        if writer.has_pending(self.key):
            writer.flush(self.key)


def record(ctx: Any, done: int, total: int | None, note: str, at: Any) -> None:
    """Hand a running step's progress to the writer."""
    writer.put(
        Value(
            using=ctx.using,
            run_id=str(ctx.run_id),
            generation=int(ctx.generation),
            done=done,
            total=total,
            note=note,
            at=at,
        )
    )
