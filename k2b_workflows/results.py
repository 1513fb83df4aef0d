"""Waiting for a run's result: ``wait_for_workflow_run`` and ``await_workflow_run``.

The failure this is built around: a caller that polls the run row either
polls fast (a query every few milliseconds per waiting request) or answers
late (up to a poll interval after the run ended). Here a run's end is
announced by the database itself (the ``notify_ended`` trigger on
``k2b_run``, in the transaction that ends the run) and one listener thread
per process, on a plain psycopg connection of its own, wakes the callers
waiting on that run. Never Django's connection: with a pool it would keep
listening for its next borrower (docs/reference, POSTGRES-FACTS).

The end notifies only a waiter: each holds its run's advisory lock, shared,
while it waits (``_wait_on``), from before its first read; the end takes it
exclusively or, when it cannot, notifies (``triggers.NotifyEnded``). A waiter
refused the lock (the end holds it: not committed yet) takes it at its next
poll; its reads go on meanwhile.

A notification is only a wake-up. Every waiter subscribes *before* it reads
the run, so an end that commits between the read and the wait still wakes
it; an end announced while the listener was disconnected (a restart) is
found because the listener wakes every waiter when it (re)connects, and by
the fallback poll every ``POLL_INTERVAL_MS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from django.db import DatabaseError, connections

from . import settings, triggers, validation
from .exceptions import InvalidInput, RunEndNotSealed
from .kernel import db, seals, weather
from .models import ENDED_CHANNEL, SETTLED_STATUSES, WorkflowRun

logger = logging.getLogger(__name__)

#: The listener closes its connection after this long without a waiter.
IDLE_CLOSE_S = 30.0
#: How long one ``notifies()`` call blocks: how soon the listener sees it is idle.
_NOTIFIES_TIMEOUT_S = 0.5


_LISTEN_ENDED_SQL = f"LISTEN {ENDED_CHANNEL}"


class EndListener:
    """One LISTEN connection per process, shared by every waiter in it.

    Started on the first wait, stopped after ``IDLE_CLOSE_S`` without one;
    restarted in a forked child (a thread does not survive a fork).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, set[Callable[[], None]]] = {}
        self._thread: threading.Thread | None = None
        self._pid = 0
        #: Set while the connection is LISTENing: a wait may then rely on notifications.
        self.listening = threading.Event()
        self.received = 0
        self._stopping = threading.Event()

    def subscribe(self, run_id: uuid.UUID, wake: Callable[[], None]) -> None:
        with self._lock:
            self._waiters.setdefault(str(run_id), set()).add(wake)
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self.listening.clear()
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._run, name="k2b-result-listener", daemon=True
                )
                self._thread.start()

    def unsubscribe(self, run_id: uuid.UUID, wake: Callable[[], None]) -> None:
        with self._lock:
            waiters = self._waiters.get(str(run_id))
            if waiters is not None:
                waiters.discard(wake)
                if not waiters:
                    del self._waiters[str(run_id)]

    def stop(self, timeout: float = 10.0) -> None:
        """Close the connection now (tests dropping their database; a process exiting)."""
        with self._lock:
            thread = self._thread
        if thread is None:
            return
        self._stopping.set()
        thread.join(timeout)
        with self._lock:
            if self._thread is thread:
                self._thread = None
            self._stopping.clear()

    def _wake(self, run_id: str | None) -> None:
        """Wake the waiters of ``run_id``, or (None) every waiter."""
        with self._lock:
            if run_id is None:
                wakes = [w for ws in self._waiters.values() for w in ws]
            else:
                wakes = list(self._waiters.get(run_id, ()))
        for wake in wakes:
            # A waiter's event loop may have closed meanwhile: that waiter is gone.
            with contextlib.suppress(Exception):
                wake()

    def _idle(self) -> bool:
        """Whether to stop: no waiter. Decided under the lock, so that a subscriber
        arriving now either is seen here or starts a new thread."""
        with self._lock:
            if self._waiters:
                return False
            if self._thread is threading.current_thread():
                self._thread = None
            self.listening.clear()
            return True

    def _run(self) -> None:
        backoff = weather.Backoff()
        idle_since: float | None = None
        while True:
            conn = None
            try:
                conn = db.autocommit_connection(settings.listen_database(), follow_clock=False)
                conn.execute(_LISTEN_ENDED_SQL)
                self.listening.set()
                backoff.reset()
                # An end committed while nobody listened: every waiter reads again.
                self._wake(None)
                while not self._stopping.is_set():
                    for note in conn.notifies(timeout=_NOTIFIES_TIMEOUT_S):
                        self.received += 1
                        self._wake(note.payload)
                    with self._lock:
                        busy = bool(self._waiters)
                    if busy:
                        idle_since = None
                    elif idle_since is None:
                        idle_since = time.monotonic()
                    elif time.monotonic() - idle_since > IDLE_CLOSE_S and self._idle():
                        return
                self.listening.clear()
                self._wake(None)  # a waiter left now polls
                return
            except Exception as exc:
                self.listening.clear()
                delay = backoff.next()
                logger.warning(
                    "result listener: %s; polling, reconnecting in %.1f s",
                    weather.describe(exc),
                    delay,
                )
                self._wake(None)
                self._stopping.wait(delay)
                if self._stopping.is_set() or self._idle():
                    return
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()


listener = EndListener()


def validate_timeout(timeout: Any, field: str = "timeout") -> float | None:
    """``None`` (wait for ever) or a positive number of seconds (or a ``timedelta``)."""
    if timeout is None:
        return None
    if isinstance(timeout, dt.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise InvalidInput(f"{field} must be a number of seconds or None, not {timeout!r:.80}")
    if not timeout > 0 or timeout == float("inf"):
        raise InvalidInput(f"{field} must be a positive number of seconds, not {timeout!r}")
    return float(timeout)


def settled_run(using: str, run_id: uuid.UUID) -> WorkflowRun | None:
    """The run if it has ended (or needs an operator), None while it may still move.

    Raises ``WorkflowRun.DoesNotExist`` for an unknown id, and ``InvalidInput``
    for a run that the caller's own open transaction created: no worker can
    see it before that transaction commits, so waiting inside it never ends.
    """
    run = WorkflowRun.objects.using(using).filter(pk=run_id).first()
    if run is None:
        raise WorkflowRun.DoesNotExist(f"run_id: no run {run_id}")
    if run.status in SETTLED_STATUSES:
        # The runtime role can write a queued run's status and output: the caller
        # would act on an end no worker reached (#35). As a parent reads a child.
        forged = seals.end_problem(run)
        if forged is not None:
            logger.error("run %s: its end is not used: %s", run_id, forged)
            raise RunEndNotSealed(run_id, forged)
        return run
    if connections[using].in_atomic_block and _written_by_this_transaction(using, run_id):
        raise InvalidInput(
            f"run {run_id} was started (or changed) in the caller's transaction, which has "
            "not committed: no worker sees it until then. Wait outside the atomic block "
            "(transaction.on_commit, or a view without ATOMIC_REQUESTS)."
        )
    return None


# The row version we read was written by this transaction or one of its
# savepoints when its xmin is still in progress: under READ COMMITTED another
# transaction's uncommitted row is never visible. A savepoint (a nested
# ``atomic()``: a ``TestCase``'s test, a view's block under ATOMIC_REQUESTS)
# writes under an id of its own, assigned after the top-level one, so comparing
# with the top-level id alone missed it and the wait sat out its timeout. xmin is
# 32 bits: it is widened to the epoch of the top-level id. Only ids from the
# top-level one to 2^31 after it are asked about: the ids of rows written since
# our transaction began; an older row's id widens to beyond that, and asking
# about an id not yet assigned raises. Bounded by the snapshot's ``xmax``
# instead, the check failed whenever no transaction newer than ours had ended:
# ``xmax`` is the latest *ended* id plus one, not the next to be assigned, so our
# own savepoint's id was at or past it on a quiet server. Special ids (below 3:
# frozen, bootstrap) are never ours.
_WRITTEN_BY_THIS_TRANSACTION_SQL = """
    SELECT CASE WHEN x.raw >= 3 AND x.mine >= x.top AND x.mine < x.top + 2147483648
                THEN pg_catalog.pg_xact_status(x.mine::text::xid8) = 'in progress'
                ELSE false END
      FROM (SELECT t.top,
                   t.top + ((r.xmin::text::bigint - t.top %% 4294967296 + 4294967296)
                            %% 4294967296) AS mine,
                   r.xmin::text::bigint AS raw
              FROM k2b_run r,
                   (SELECT pg_catalog.pg_current_xact_id_if_assigned()::text::bigint AS top) t
             WHERE r.id = %s AND t.top IS NOT NULL) x
"""


def _written_by_this_transaction(using: str, run_id: uuid.UUID) -> bool:
    rows = db.fetchall(using, _WRITTEN_BY_THIS_TRANSACTION_SQL, [run_id])
    return bool(rows and rows[0][0])


_WAIT_ON_SQL = "SELECT pg_try_advisory_lock_shared({})".format(
    triggers.WAITED_LOCK.format(run_id="%s")
)
_WAITED_SQL = "SELECT pg_advisory_unlock_shared({})".format(
    triggers.WAITED_LOCK.format(run_id="%s")
)


def _wait_on(using: str, run_id: uuid.UUID) -> bool:
    """Tell the run's end that a waiter is here (its advisory lock, shared, on this
    session): from now on the end notifies. False while an end holds the lock."""
    return bool(db.fetchall(using, _WAIT_ON_SQL, [str(run_id)])[0][0])


def _waited(using: str, run_id: uuid.UUID) -> None:
    """Give the lock of ``_wait_on`` back. A session that cannot (its transaction
    broken, its connection gone) releases it when it ends; until then the run's
    end only notifies once more than it needs to."""
    with contextlib.suppress(DatabaseError):
        db.fetchall(using, _WAITED_SQL, [str(run_id)])


def _poll_s() -> float:
    return max(settings.poll_interval_ms(), 10) / 1000


def wait_for_workflow_run(
    run_id: uuid.UUID | str, timeout: float | dt.timedelta | None = None
) -> WorkflowRun:
    """Block until the run is succeeded, failed, canceled or needs_attention; return it.

    Woken by the run's end notification, within milliseconds; polls every
    ``POLL_INTERVAL_MS`` only as a fallback. Raises ``TimeoutError`` after
    ``timeout`` seconds (real seconds; ``None``: no limit),
    ``WorkflowRun.DoesNotExist`` for an unknown run id, ``RunEndNotSealed``
    when the run's end does not match its seal (not written by the kernel). Safe in a Django view:
    it reads through Django's connection (so under READ COMMITTED each read
    sees the latest commit) and listens on a connection of its own.
    """
    run_id = validation.run_id(run_id)
    limit = validate_timeout(timeout)
    using = settings.database()
    deadline = None if limit is None else time.monotonic() + limit
    woken = threading.Event()
    listener.subscribe(run_id, woken.set)
    held = False
    try:
        while True:
            woken.clear()
            held = held or _wait_on(using, run_id)
            run = settled_run(using, run_id)
            if run is not None:
                return run
            wait = _poll_s()
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"run {run_id} has not ended after {limit} s")
                wait = min(wait, remaining)
            woken.wait(wait)
    finally:
        listener.unsubscribe(run_id, woken.set)
        if held:
            _waited(using, run_id)


async def await_workflow_run(
    run_id: uuid.UUID | str, timeout: float | dt.timedelta | None = None
) -> WorkflowRun:
    """``wait_for_workflow_run`` for async code: the event loop is never blocked.

    The wait is an ``asyncio.Event`` set by the process's listener thread; each
    read of the run runs in a thread (``sync_to_async``), as Django's async ORM
    does.
    """
    from asgiref.sync import sync_to_async

    run_id = validation.run_id(run_id)
    limit = validate_timeout(timeout)
    using = settings.database()
    loop = asyncio.get_running_loop()
    deadline = None if limit is None else loop.time() + limit
    woken = asyncio.Event()

    def wake() -> None:
        loop.call_soon_threadsafe(woken.set)

    read = sync_to_async(settled_run)
    wait_on = sync_to_async(_wait_on)
    listener.subscribe(run_id, wake)
    held = False
    try:
        while True:
            woken.clear()
            held = held or await wait_on(using, run_id)
            run = await read(using, run_id)
            if run is not None:
                return run
            wait = _poll_s()
            if deadline is not None:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError(f"run {run_id} has not ended after {limit} s")
                wait = min(wait, remaining)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), wait)
    finally:
        listener.unsubscribe(run_id, wake)
        if held:
            await sync_to_async(_waited)(using, run_id)
