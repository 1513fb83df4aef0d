"""The lease keeper: renews the leases of runs this process executes.

It renews while an action runs, up to the action's timeout; a process that
is stopped (SIGSTOP) or frozen renews nothing and is fenced out when its
lease expires. It also notices cancellations and lost leases within a tick
and sets the execution's ``ctx.canceled`` event (the abort signal).

It holds a connection of its own from the start, and the worker claims
nothing while it has none (``ready``): under a shortage of connections
("remaining connection slots are reserved") a keeper that connected only
when it first had to renew found none, and every run it held expired
mid-step and ran again, until its retries were exhausted. A shortage now
delays new claims; it never expires a lease that is held.

The same connection holds the worker's presence lock (``holders.py``, #47):
a takeover leaves a run inside an external call to a holder whose lock is
held, and a run ended under its action keeps its slot until that holder
says, on this connection, that the action has left ``run()`` (``leave``).
So it is opened on ``LISTEN_DATABASE``, the connection that must not go
through a transaction pooler (a session lock there would outlive us). It
also holds a call lock for each run whose external call the worker is
inside (``calling``), and, once it holds all of those, the reporting lock
that tells a takeover to trust them: a worker alive but out of the call
(its answer lost with a failover) is not waited for.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import counters, settings
from . import clock, db, flow, holders, weather
from .claim import renew_leases

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 0.25

_ENDED = frozenset({"succeeded", "failed", "canceled"})

#: Cancels heard of runs this process did not execute yet, kept for when it does.
MAX_TOLD = 1000


@dataclass
class _Held:
    generation: int
    event: threading.Event
    action_deadline: float | None = None
    action_started: float | None = None
    #: An EXTERNAL (or stronger) ``run()`` is in flight: its effect may land at any moment.
    external: bool = False
    #: Set when ``tasks.cancel`` asked the run's call to stop (#49); None: not watched.
    asked: threading.Event | None = None


#: Held runs no longer running, or whose call was asked to stop (``tasks.cancel``): the
#: keeper tells their threads.
_NOT_RUNNING_SQL = (
    "SELECT id, status, generation, cancel_requested_at IS NOT NULL FROM k2b_run"
    " WHERE id = ANY(%s) AND (status <> 'running' OR cancel_requested_at IS NOT NULL)"
)

_RENEW_TASKS_SQL = (
    "UPDATE k2b_ai_task"
    " SET lease_expires_at = k2b_now() + %s * interval '1 millisecond'"
    " WHERE id = ANY(%s) AND status = 'running'"
)

_TASK_STATES_SQL = "SELECT id, status, generation FROM k2b_ai_task WHERE id = ANY(%s)"


@dataclass
class LeaseKeeper:
    using: str
    #: The worker's id: its presence lock is taken on the keeper's connection. Empty:
    #: none (a keeper of ``testing.run_to_end``, which no other process races).
    worker_id: str = ""
    #: Set while the keeper's connection holds the presence lock.
    present: threading.Event = field(default_factory=threading.Event)
    #: Runs ended under our action that has left ``run()``: their slots to let go
    #: of, on this connection (``leave``), retried at each tick until done.
    _leaving: dict[Any, int] = field(default_factory=dict)
    #: The keeper's connection reaches PostgreSQL through a pooler or a proxy.
    _proxied: bool = False
    #: The keeper's connection holds the reporting lock (``holders.REPORTING_LOCK``).
    _reporting: bool = False
    #: Runs whose external call this worker is inside (``calling``), and those of them
    #: whose call lock the current connection holds. Guarded by ``_connecting``.
    _calls: set[Any] = field(default_factory=set)
    _locked_calls: set[Any] = field(default_factory=set)
    #: Calls left whose lock is still held: given back with the next call's lock, or at
    #: the next tick. Held a moment too long, a lock makes a takeover wait, never race.
    _unlocking: list[Any] = field(default_factory=list)
    _runs: dict[Any, _Held] = field(default_factory=dict)
    _tasks: dict[Any, _Held] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: Held while a tick talks to the database (see ``paused``).
    _ticking: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    #: Set to look at the held runs now, not at the next tick (``look_now``).
    _poke: threading.Event = field(default_factory=threading.Event)
    #: Runs a cancel was asked of that this process does not execute yet (a run claimed
    #: ahead, or about to be): told when its execution starts (``track``). Bounded.
    _told: dict[Any, None] = field(default_factory=dict)
    _connecting: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None
    _conn: Any = None

    # -- bookkeeping, called by executing threads --

    def track(
        self,
        run_id: uuid.UUID,
        generation: int,
        event: threading.Event,
        asked: threading.Event | None = None,
    ) -> None:
        with self._lock:
            self._runs[run_id] = _Held(generation, event, asked=asked)
            if asked is not None and run_id in self._told:
                # Asked while it waited here, claimed ahead (#49): its execution is told.
                del self._told[run_id]
                asked.set()

    def untrack(self, run_id: uuid.UUID) -> None:
        with self._lock:
            self._runs.pop(run_id, None)

    def action_started(
        self, run_id: uuid.UUID, timeout_s: float | None, external: bool = False
    ) -> None:
        timeout = timeout_s if timeout_s is not None else settings.action_timeout_ms() / 1000
        with self._lock:
            if run_id in self._runs:
                # On the kernel's clock: a test that moves it past the timeout sees
                # the abort signal and the lease left to expire, as after a real wait.
                now = clock.monotonic()
                self._runs[run_id].action_deadline = now + timeout
                self._runs[run_id].action_started = now
                self._runs[run_id].external = external

    def action_finished(self, run_id: uuid.UUID) -> None:
        with self._lock:
            if run_id in self._runs:
                self._runs[run_id].action_deadline = None
                self._runs[run_id].action_started = None
                self._runs[run_id].external = False

    def in_time(self) -> list[Any]:
        """Runs this process executes whose action, if one is running, is within its
        timeout: the reaper of this process leaves them to this keeper, however late
        it renews them (``claim.reap_expired``)."""
        now = clock.monotonic()
        with self._lock:
            return [
                run_id
                for run_id, held in self._runs.items()
                if held.action_deadline is None or now <= held.action_deadline
            ]

    def external_in_flight(self) -> set[Any]:
        """Runs whose external ``run()`` has been called and has not returned."""
        with self._lock:
            return {run_id for run_id, held in self._runs.items() if held.external}

    def calls_in_flight(self) -> set[Any]:
        """Runs whose external call this worker is inside (``calling``): from before its
        dispatch commits until ``run()`` has returned. A stopping worker waits for them.

        A copy taken without ``_connecting``, which a reconnection holds for as long
        as the connection takes: a worker told to stop must not wait for it to look.
        """
        return self._calls.copy() | self.external_in_flight()

    def track_task(self, task_id: Any, generation: int, event: threading.Event) -> None:
        with self._lock:
            self._tasks[task_id] = _Held(generation, event)

    def untrack_task(self, task_id: Any) -> None:
        with self._lock:
            self._tasks.pop(task_id, None)

    @property
    def busy(self) -> int:
        with self._lock:
            return len(self._runs) + len(self._tasks)

    @contextlib.contextmanager
    def paused(self, timeout: float = 5.0) -> Iterator[None]:
        """No renewal runs inside this block: the worker hands runs back in it.

        A renewal locks the rows it renews until it commits, and a hand-back
        skips locked rows (they may be a step's, whose commit the fence must
        refuse). Run at the same moment, the hand-back would take our own
        renewal for a step and leave the run to its lease. ``timeout``: a tick
        stuck on a database that went away does not hold the hand-back longer.
        """
        paused = self._ticking.acquire(timeout=timeout)
        try:
            yield
        finally:
            if paused:
                self._ticking.release()

    # -- the thread --

    @property
    def ready(self) -> bool:
        """Whether the keeper holds an open connection: only then may the worker claim."""
        conn = self._conn
        return conn is not None and not conn.closed

    def connect(self) -> bool:
        """Hold a connection now if there is none (the claim loop asks before claiming);
        False when none can be had."""
        try:
            self._connection()
        except Exception as exc:
            logger.debug("lease keeper: no connection: %s", exc)
            return False
        return True

    def start(self) -> None:
        """Connect, then renew, in a thread of its own. The connection is opened at once,
        while the worker starts its other threads; the first claim waits for it
        (``ready``, ``connect``)."""
        self._thread = threading.Thread(target=self._run, name="k2b-lease-keeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with contextlib.suppress(Exception):  # the loop reconnects and says why
            self._connection()
        self._loop()

    def look_now(self, run_id: str) -> None:
        """A cancel of ``run_id`` was asked (the listener heard it, #49): if this process
        executes it, look at its held runs at once rather than at the next tick."""
        try:
            key = uuid.UUID(run_id)
        except ValueError:
            return
        with self._lock:
            held = key in self._runs
            if not held:
                # Perhaps claimed by this worker a moment from now: told when it starts.
                # A run of another worker's costs an entry, dropped past the bound.
                self._remember_told(key)
        if held:
            self._poke.set()

    def _remember_told(self, run_id: Any) -> None:
        """Keep that ``run_id`` was asked until its execution starts (``track``); under
        ``_lock``. The oldest entries go past ``MAX_TOLD``."""
        self._told[run_id] = None
        while len(self._told) > MAX_TOLD:
            self._told.pop(next(iter(self._told)))

    def stop(self) -> None:
        self._stop.set()
        self._poke.set()
        if self._thread:
            self._thread.join(timeout=5)
        self._drop_connection()

    def _drop_connection(self) -> None:
        self._reporting = False
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _connection(self) -> Any:
        # The keeper's thread and the claim loop (``connect``) both open it: once.
        with self._connecting:
            if self._conn is None or self._conn.closed:
                self.present.clear()
                self._proxied = False
                self._reporting = False
                self._locked_calls.clear()
                self._unlocking.clear()
                alias = settings.listen_database() if self.worker_id else self.using
                self._conn = db.autocommit_connection(alias)
            if self.worker_id and not self.present.is_set() and not self._proxied:
                # Not granted: held a moment by a takeover that tried it, or by our
                # previous connection's session not ended yet. Asked again next tick.
                port = self._conn.info.port
                row = self._conn.execute(
                    holders.TAKE_PRESENCE_SQL, [port, self.worker_id]
                ).fetchone()
                if row and row[0] is None:
                    self._proxied = True
                    logger.info(
                        "lease keeper: the database is behind a pooler or a proxy (port %s);"
                        " no presence lock, the heartbeat tells that this worker is alive",
                        port,
                    )
                elif row and row[0]:
                    self.present.set()
            if self.worker_id and not self._reporting and not self._proxied:
                self._report_calls(self._conn)
            return self._conn

    def _report_calls(self, conn: Any) -> None:
        """Take the call lock of every call we are inside, then the reporting lock.

        In that order: a takeover that finds the reporting lock held takes a free
        call lock for "not in that call". Not granted (a takeover held it a
        moment), the reporting lock is asked again at the next tick.
        """
        for run_id in self._calls - self._locked_calls:
            conn.execute(holders.LOCK_CALL_SQL, [self.worker_id, run_id])
            self._locked_calls.add(run_id)
        row = conn.execute(holders.TAKE_REPORTING_SQL, [self.worker_id]).fetchone()
        self._reporting = bool(row and row[0])

    @contextlib.contextmanager
    def calling(self, run_id: uuid.UUID) -> Iterator[None]:
        """Around an external call of ``run_id``: its dispatch's commit, then ``run()``.

        Entered before the dispatch commits, left once ``run()`` has returned: a
        takeover that reads the dispatch finds the call lock held for as long as
        the call may go on (``holders.inside``). A lock that cannot be taken or
        given back costs the connection, and the reporting lock with it: presence
        then decides, which waits rather than races.
        """
        if not self.worker_id:
            yield
            return
        with self._connecting:
            self._calls.add(run_id)
            if self._reporting:
                unlocks = self._unlocking
                params = [self.worker_id, run_id]
                for done in unlocks:
                    params += [self.worker_id, done]
                try:
                    self._conn.execute(holders.calls_sql(True, len(unlocks)), params)
                    self._locked_calls.add(run_id)
                    unlocks.clear()
                except Exception as exc:
                    logger.warning("lease keeper: call lock not taken: %s", exc)
                    self._drop_connection()
        try:
            yield
        finally:
            with self._connecting:
                self._calls.discard(run_id)
                if run_id in self._locked_calls:
                    self._locked_calls.discard(run_id)
                    self._unlocking.append(run_id)

    def _give_back_calls(self) -> None:
        """The locks of calls left since the last call began, of runs this process no
        longer executes: at a tick, in one statement.

        A run still executing keeps its call's lock until its next call or its end.
        Left, the call has returned, but its outcome may not have committed yet: a
        holder starved between the two (its lease run out) was taken over as out of
        the call, and its answer, which came next, found an incident in its place.
        """
        with self._lock:
            executing = set(self._runs)
        with self._connecting:
            unlocks = [run_id for run_id in self._unlocking if run_id not in executing]
            if not unlocks or self._conn is None:
                return
            params: list[Any] = []
            for done in unlocks:
                params += [self.worker_id, done]
            try:
                self._conn.execute(holders.calls_sql(False, len(unlocks)), params)
                self._unlocking[:] = [r for r in self._unlocking if r in executing]
            except Exception as exc:
                logger.warning("lease keeper: call locks not given back: %s", exc)
                self._drop_connection()

    def leave(self, run_id: uuid.UUID, generation: int) -> None:
        """Our action has left ``run()`` of a run that ended under it: let its slot go.

        On this connection, which holds our presence lock: the slot's trigger
        lets a present holder's slot go only there (``triggers.SlotRelease``).
        Not reached now (the database is away), it is sent again at each tick.
        """
        with self._lock:
            self._leaving[run_id] = generation
        with contextlib.suppress(Exception), self._ticking:
            self._send_leaves(self._connection())

    def _send_leaves(self, conn: Any) -> None:
        with self._lock:
            leaving = dict(self._leaving)
        for run_id, generation in leaving.items():
            flow.leave_on(conn, run_id, generation)
            with self._lock:
                self._leaving.pop(run_id, None)

    def _loop(self) -> None:
        last_renew = 0.0
        backoff = weather.Backoff(first=CHECK_INTERVAL_S, cap=2.0)
        delay = CHECK_INTERVAL_S
        while True:
            # Woken early by ``look_now`` (a cancel asked of a run we hold) or ``stop``.
            self._poke.wait(delay)
            if self._stop.is_set():
                break
            look = self._poke.is_set()
            self._poke.clear()
            try:
                renew_every = settings.lease_ms() / 3000
                renew = time.monotonic() - last_renew >= renew_every
                # Connected before anything needs renewing, and kept: a connection
                # opened only when a lease is due may not be there to be had.
                self._connection()
                with self._ticking:
                    self.tick(renew=renew, look=look)
                if renew:
                    last_renew = time.monotonic()
                backoff.reset()
                delay = CHECK_INTERVAL_S
            except Exception as exc:
                # Leases not renewed while the database is away expire, and the
                # fence keeps whatever this process then writes from committing.
                delay = backoff.next()
                if weather.is_connection_error(exc):
                    counters.count_db_reconnect("lease_keeper")
                    logger.warning(
                        "lease keeper: database unavailable: %s; reconnecting in %.1f s",
                        weather.describe(exc),
                        delay,
                    )
                    self._drop_connection()
                else:
                    logger.exception("lease keeper: tick failed; retrying in %.1f s", delay)
                    if self._conn is not None and self._conn.broken:
                        self._drop_connection()

    def tick(self, *, renew: bool, look: bool = False) -> None:
        """Renew the held leases (``renew``), else look at the runs whose action has run
        a while; ``look``: at every held run (a cancel was asked of one of them)."""
        now = clock.monotonic()
        self._give_back_calls()
        with self._lock:
            runs = dict(self._runs)
            tasks = dict(self._tasks)
            leaving = bool(self._leaving)
        if leaving:
            self._send_leaves(self._connection())
        if not renew and not look:
            # Between renewals only an action that has run for a while can use the
            # abort signal: a short one ends first, and its run's next write is
            # fenced anyway. Checking every held run four times a second would be
            # a query (and a commit) per tick for nothing.
            runs = {
                run_id: held
                for run_id, held in runs.items()
                if held.action_started is not None and now - held.action_started >= CHECK_INTERVAL_S
            }
        if not runs and not tasks:
            return
        conn = self._connection()
        lease = settings.lease_ms()
        if runs and renew:
            keep = {}
            for run_id, held in runs.items():
                if held.action_deadline is not None and now > held.action_deadline:
                    # Past the action's timeout: stop renewing, let the lease expire.
                    held.event.set()
                    continue
                keep[run_id] = held.generation
            _, states, asked = renew_leases(conn, keep, lease)
            self._mark(runs, states)
            self._asked(runs, asked)
            # Ended under us (a cancel, a timeout) while the action is inside run():
            # its slot stays held until it has left (#35).
            flow.hold_slots(
                conn,
                {
                    run_id: generation
                    for run_id, (status, generation) in states.items()
                    if status in _ENDED and keep.get(run_id) == generation
                },
                lease,
            )
        elif runs:
            rows = conn.execute(
                _NOT_RUNNING_SQL,
                [list(runs)],
            ).fetchall()
            self._mark(runs, {r[0]: (r[1], r[2]) for r in rows})
            self._asked(runs, {r[0] for r in rows if r[3]})
        if tasks:
            ids = list(tasks)
            if renew:
                conn.execute(
                    _RENEW_TASKS_SQL,
                    [lease, ids],
                )
            for task_id, status, generation in conn.execute(_TASK_STATES_SQL, [ids]).fetchall():
                held = tasks[task_id]
                if status != "running" or generation != held.generation:
                    held.event.set()

    def _asked(self, runs: dict[Any, _Held], asked: set[Any]) -> None:
        """Tell the calls of ``asked`` that ``tasks.cancel`` asked them to stop (#49)."""
        for run_id in asked:
            held = runs.get(run_id)
            if held is None:
                continue
            if held.asked is not None:
                held.asked.set()
            else:
                # Claimed ahead, its execution not started: told when it starts (#49).
                with self._lock:
                    self._remember_told(run_id)

    def _mark(self, runs: dict[Any, _Held], states: dict[Any, tuple]) -> None:
        for run_id, (status, generation) in states.items():
            held = runs.get(run_id)
            if held is None:
                continue
            if status != "running" or generation != held.generation:
                held.event.set()
