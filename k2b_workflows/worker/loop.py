"""The worker: a pool of threads executing claimed runs, woken by LISTEN, polling as a fallback.

``manage.py runworkflows`` is a thin shell around ``Worker``. Several worker
processes on several hosts share one PostgreSQL; nothing else coordinates them.

Threads:

- the main loop claims runs (and AI tasks) in batches for free slots plus a
  prefetch (``CLAIM_PREFETCH``, more on a backlog of short runs: ``prefetch.py``)
  into a local queue (``claims.py``), starts idle pool threads on it, then
  sleeps until a notification, a free slot, a low queue, the next due run, or
  the poll interval;
- a pool thread that finishes a run starts the next queued one itself: no
  thread waits for the main loop (a claim and its reads) between runs
  (``runner.py``);
- a listener on its own autocommit psycopg connection (a pooled Django
  connection would keep listening for its next borrower) sets the wake-up
  (``wakeups.py``);
- the lease keeper renews leases and notices cancellations;
- the main loop also runs housekeeping and, unless started with
  ``schedules=False``, schedule passes (``housekeeping.py``,
  ``kernel/schedule_passes.py``): it asks when the next tick fires at most
  once per ``SCHEDULE_PASS_INTERVAL_MS``, wakes for it, and fires due ticks
  in a transaction of their own, never inside a claim;
- the heartbeat keeps this process's row in the fleet table fresh
  (``fleet.py``), and, with ``metrics_port``, an HTTP thread serves metrics.

No database error ends the process (``kernel/weather.py``): every thread
closes its broken connection, logs one line, backs off with jitter and
reconnects. The process exits on SIGTERM/SIGINT (once its external calls in
flight have returned, handing its other runs back), or
at start-up on a configuration error (an unmigrated database, a bad URL:
``startup.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from django.db import DatabaseError, connections

from .. import fleet, metrics, settings
from ..kernel import ai, claim, weather
from ..kernel.leases import LeaseKeeper
from ..kernel.load import Preloaded
from . import startup
from .claims import Claims
from .connections import ThreadConnections
from .health import HealthFile
from .housekeeping import Housekeeping, SchedulePasses
from .options import WorkerOptions
from .prefetch import Prefetch
from .runner import Runner
from .selection import Selection
from .status import StatusLine, default_status_stream
from .wakeups import Listener

__all__ = ["Worker", "WorkerOptions", "default_status_stream"]

logger = logging.getLogger(__name__)
#: The start and stop lines go to the package's logger by name: docs/operations.md
#: shows them as ``k2b_workflows: worker ...``, and supervisors' log filters match it.
lifecycle = logging.getLogger("k2b_workflows")

#: Seconds an idle loop goes on probing (``Worker._probe``) before a full pass again.
IDLE_FULL_ROUND_S = 10.0


class Worker:
    """Claims and executes runs until stopped (or, with ``burst``, until nothing is left).

    The state lives in its parts: what it takes (``selection``), the runs it
    holds (``claims``), the pool threads' side (``runner``), and the periodic
    passes (``housekeeping``, ``schedule_passes``); this class starts, loops
    and shuts down.
    """

    def __init__(self, options: WorkerOptions | None = None, /, **fields: Any) -> None:
        """``options``, or ``WorkerOptions``' fields by name (``Worker(concurrency=4)``)."""
        options = dataclasses.replace(options or WorkerOptions(), **fields)
        self.options = options
        concurrency, schedules = options.concurrency, options.schedules
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.selection = Selection(options.app_ids, options.queues)
        self.concurrency = concurrency
        self.burst = options.burst
        self.using = options.using or settings.database()
        self.worker_id = (
            options.worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        )
        self.listen = options.listen
        self.status_stream = options.status_stream
        self.stats: Counter[str] = Counter()
        self.stopping = threading.Event()
        self.wake = threading.Event()
        self.keeper = LeaseKeeper(self.using, worker_id=self.worker_id)
        #: The claim loop waits for the keeper's connection (logged once per wait).
        self._keeper_waiting = False
        self.prefetch = Prefetch(settings.claim_prefetch(), concurrency)
        self._lock = threading.Lock()
        self.claims = Claims(
            using=self.using,
            worker_id=self.worker_id,
            selection=self.selection,
            keeper=self.keeper,
            stats=self.stats,
            lock=self._lock,
            wake=self.wake,
        )
        self.runner = Runner(
            using=self.using,
            claims=self.claims,
            keeper=self.keeper,
            prefetch=self.prefetch,
            stats=self.stats,
            lock=self._lock,
            stopping=self.stopping,
            wake=self.wake,
        )
        self.housekeeping = Housekeeping(
            self.using, self.stats, self.worker_id, self.keeper.in_time
        )
        self.schedule_passes = SchedulePasses(
            self.using, self.selection.workflows, self.stats, enabled=schedules
        )
        #: At start-up, give up after this many seconds without a database (None: never).
        self.wait_for_db = options.wait_for_db
        #: Where start-up notices go ("waiting for the database"), besides the log.
        self.notice_stream = options.notice_stream
        self.health = HealthFile(options.health_file) if options.health_file else None
        self.metrics_port = options.metrics_port
        self.heartbeat = fleet.Heartbeat(
            using=self.using,
            worker_id=self.worker_id,
            concurrency=concurrency,
            app_ids=self.app_ids,
            in_flight=self.in_flight,
        )
        #: The pool threads' and the main loop's connections.
        self.connections = ThreadConnections(self.using, concurrency, self.stopping)
        self.status = StatusLine(self.worker_id, concurrency)
        #: Set by a second SIGTERM/SIGINT: hand back and exit without waiting for steps.
        self.forced = threading.Event()
        #: Pool threads still inside a step when the worker returned (shutdown grace ran
        #: out): the process must exit without joining them (``os._exit``).
        self.abandoned = 0
        #: The LISTEN thread, once started (``_start_listener``).
        self._listener: Listener | None = None
        #: The last full pass found nothing to claim or do: the next pass probes (#52).
        self._idle = False
        #: ``time.monotonic()`` of the last full pass.
        self._last_full = 0.0
        #: The last wait ended on ``wake`` (a notification, a run's end): pass in full.
        self._woken = False

    @property
    def app_ids(self) -> list[str] | None:
        """The ``--app`` ids this worker takes runs of (None: every app)."""
        return self.selection.app_ids

    @property
    def queues(self) -> list[str] | None:
        """``--queue``: only task runs of these django.tasks queues (None: every run)."""
        return self.selection.queues

    @property
    def schedules(self) -> bool:
        """Whether this worker runs schedule passes (``runworkflows --no-schedules``: False)."""
        return self.schedule_passes.enabled

    # -- lifecycle -----------------------------------------------------------

    def run(self) -> None:
        """Start, claim and execute until stopped (or, with ``burst``, until idle).

        Between the schema check and the first claim, what waits on the network
        overlaps: the topology probes run in a thread of their own (they only
        log), and the heartbeat, the lease keeper and every pool thread connect
        in theirs while this thread imports and creates the metrics.
        """
        self.start_up()
        if self.stopping.is_set():
            return
        probes = startup.say_topology_in_background(self.worker_id, self.using, self.listen)
        names = self.selection.workflows()
        lifecycle.info(
            "worker %s: %d thread(s), apps %s, %d workflow version(s)%s",
            self.worker_id,
            self.concurrency,
            self.app_ids or "all",
            len(names),
            " (burst)" if self.burst else "",
        )
        self.selection.say_unknown_apps(self.worker_id)
        self.connections.watch()
        self.heartbeat.start()
        self.keeper.start()
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="k2b-worker")
        try:
            self.connections.connect_threads(pool)
            metrics.prepare()
            if self.metrics_port is not None:
                port = metrics.serve(self.metrics_port, using=self.using)
                logger.info("worker %s: metrics on port %d", self.worker_id, port)
            if not self.burst:
                self._start_listener()
            self._loop(pool)
        finally:
            # Graceful: executions stop after their current step and release their runs;
            # external calls in flight are waited for, and what else is still running
            # when the grace period ends is handed back.
            self.stopping.set()
            self._shut_down(pool)
            listener = self._listener
            if listener:
                listener.stop()  # joined below, after the others' stops overlapped its wait
            self.keeper.stop()
            self.heartbeat.stop()
            if listener:
                listener.join(timeout=5)
            # Its lines belong to this worker's log, before the last one (a probe
            # through a transaction pooler waits out topology.PROBE_TIMEOUT_S, 3 s).
            probes.join(timeout=10)
            if self.health:
                self.health.remove()
            self._show_status(final=True)
            if not connections[self.using].in_atomic_block:  # e.g. call_command in a test
                weather.close_quietly(self.using)
            self.connections.unwatch()
        lifecycle.info("worker %s stopped: %s", self.worker_id, dict(self.stats))

    def _start_listener(self) -> None:
        """LISTEN from now on. A burst worker starts listening only once it first waits:
        one that finds nothing to do exits without opening that connection."""
        if self.listen and self._listener is None:
            self._listener = Listener(
                settings.listen_database(), self.app_ids, self.wake, self.keeper.look_now
            )
            self._listener.start()

    # -- start-up --------------------------------------------------------------

    def start_up(self) -> None:
        """Wait for the database (up to ``wait_for_db``), then check its schema
        (``startup.wait_for_database``, which says what it raises)."""
        startup.wait_for_database(
            self.using, wait_for_db=self.wait_for_db, stopping=self.stopping, notice=self._notice
        )

    def _notice(self, line: str) -> None:
        logger.warning("worker %s: %s", self.worker_id, line)
        if self.notice_stream is not None:
            self.notice_stream.write(line + "\n")
            self.notice_stream.flush()

    # -- shutting down ---------------------------------------------------------

    def _shut_down(self, pool: ThreadPoolExecutor) -> None:
        """Let steps in flight finish, then hand back the runs still claimed.

        A step inside an external call (``LeaseKeeper.calling``: from its dispatch's
        commit until ``run()`` returns) is waited for until it returns, however long
        that takes: a deploy never cuts a call by itself. Cut, the call's outcome
        would be unknown to the next worker, an incident for an operator unless the
        action reconciles, though the provider may never have been called. Every
        other step (pure, idempotent, transactional: nothing in doubt if it is cut)
        gets up to ``SHUTDOWN_GRACE_MS``. Only a second SIGTERM/SIGINT (``forced``)
        or a SIGKILL cuts a call.

        Handing back (queued, no failure counted) lets another worker continue a
        run now instead of after its lease expires. Two cases are not handed back
        at once, because this process may still commit or cause an effect:

        - a run whose row is locked by one of our step transactions (a
          TRANSACTIONAL step): it is skipped, and taken over when its lease expires
          (the server rolls the transaction back when this process exits);
        - a run whose EXTERNAL ``run()`` is in flight (after a second signal): it is
          handed back with ``run_after`` one lease ahead, so the provider call this
          process made has the same time to land as after a crash before anyone
          reconciles it, and the late result this thread may still write is fenced
          out as evidence.
        """
        # Runs claimed ahead of the threads were never started: back to the queue now.
        self.claims.release_ready()
        self._wait_for_steps(time.monotonic() + settings.shutdown_grace_ms() / 1000)
        with self._lock:
            still = set(self.claims.inflight)
        if still:
            self.claims.hand_back_claimed()
        with self._lock:
            still = {f for f in self.claims.inflight if not f.done()}
        if still:
            self.abandoned = len(still)
            logger.warning(
                "worker %s: %d step(s) still running after the grace period; exiting without them",
                self.worker_id,
                len(still),
            )
            pool.shutdown(wait=False, cancel_futures=True)
            return
        try:
            self.claims.hand_back_pending()
        except DatabaseError as exc:
            weather.close_quietly(self.using)
            logger.warning("could not hand back runs (%s); their leases will expire", exc)
        self.claims.drain()
        self.connections.close_all(pool)
        pool.shutdown(wait=True)

    def _wait_for_steps(self, deadline: float) -> None:
        """Wait for every step in flight until ``deadline``, and past it for each run
        inside an external call until its step has ended; return early on ``forced``.

        At the deadline the runs outside a call are handed back (their threads'
        writes fenced from then on): another worker continues them while this one
        waits. A run whose call returned is still waited for until its thread has
        written the result and released it: handed back before, the result would be
        fenced out, and the call's outcome lost after all. The lease keeper renews
        those runs meanwhile, nothing new is claimed (``stopping``), and the health
        file stays fresh: a liveness probe must not kill a worker that waits for a
        call (its SIGKILL would cut it).
        """
        calls = self.keeper.calls_in_flight()
        if calls:
            logger.info(
                "worker %s: stopping; waiting for %d external call(s) in flight to return"
                " (no time limit; a second SIGTERM hands them back as unknown outcomes),"
                " other steps for up to %.1f s",
                self.worker_id,
                len(calls),
                max(deadline - time.monotonic(), 0.0),
            )
        waited: set[uuid.UUID] = set()
        said = -1
        while not self.forced.is_set():
            with self._lock:
                pending = set(self.claims.inflight)
                claimed = set(self.claims.claimed)
            if not pending:
                return
            if self.health:
                self.health.touch()
            left = deadline - time.monotonic()
            if left > 0:
                wait_futures(pending, timeout=min(left, 0.2), return_when=FIRST_COMPLETED)
                continue
            waited = (waited | self.keeper.calls_in_flight()) & claimed
            if not waited:
                return
            if said < 0:
                self.claims.hand_back_claimed(keep=waited)
            if len(waited) != said:
                said = len(waited)
                logger.warning(
                    "worker %s: grace period over; waiting for %d external call(s) in flight"
                    " to return; a second SIGTERM hands them back as unknown outcomes",
                    self.worker_id,
                    said,
                )
            wait_futures(pending, timeout=0.2, return_when=FIRST_COMPLETED)

    def _show_status(self, final: bool = False) -> None:
        busy = self.claims.in_flight()
        self.status.show(self.status_stream, self.stats, busy, final=final)

    def stop(self, *, force: bool = False) -> None:
        """Stop claiming; running executions finish their current step and release the run.

        Steps inside an external call are waited for until the call returns, others
        for up to ``SHUTDOWN_GRACE_MS`` (``_shut_down``). ``force`` (a second
        signal): wait for nothing, not even a call; hand every run back now.
        """
        self.stopping.set()
        if force:
            self.forced.set()
        self.wake.set()

    # -- the loop ------------------------------------------------------------

    def _loop(self, pool: ThreadPoolExecutor) -> None:
        poll = settings.poll_interval_ms() / 1000
        backoff = weather.Backoff()
        while not self.stopping.is_set():
            try:
                if self._iteration(pool, poll):
                    return
                backoff.reset()
            except Exception as exc:
                self._weather("claim loop", exc, backoff)

    def _iteration(self, pool: ThreadPoolExecutor, poll: float) -> bool:
        """One pass of the loop; True when a burst worker is done."""
        self.wake.clear()
        self.claims.hand_back_pending()
        if self.connections.orphans_possible:
            self.claims.hand_back_orphans()
            self.connections.orphans_possible = False
        if self._idle and not self._woken and not self.burst:
            due = self._probe()
            if due is not None:
                if self.schedule_passes.fire():
                    self._idle = False
                    return False
                self._sleep(poll, due)
                return False
        self._last_full = time.monotonic()
        # Claim first: housekeeping (a transaction of five statements) then overlaps
        # the first steps, and a run it makes claimable is claimed at once (wake).
        started = self._fill(pool)
        found = self.housekeeping.run(poll) + self.schedule_passes.fire()
        if found:
            self.wake.set()
        if self.health:
            self.health.touch()
        self._show_status()
        self._idle = not (started or found)
        if started:
            return False
        busy = self.claims.in_flight()
        admitted_until = self.housekeeping.admitted_until
        if (
            self.burst
            and self.claims.idle()
            and not self.selection.pending(self.using, admitted_until)
        ):
            # One last pass before leaving, whenever the last one ran: the batch whose
            # last member this worker just ended gets its callbacks now (#50), not
            # from whichever worker starts next.
            return not self.housekeeping.run(0)
        due = None
        if busy < self.concurrency:
            # With every thread busy nothing can be claimed before one ends
            # (which sets ``wake``): skip the query, one commit per run saved.
            due = claim.next_due_in_ms(self.using)
        self._sleep(poll, due)
        return False

    def _probe(self) -> float | None:
        """An idle pass: one statement, no transaction (#52). Returns how long to sleep
        (ms, or inf for a poll), or None when the pass must be a full one.

        A full pass (claim, AI claim, housekeeping) is a dozen statements and two
        transactions, and after a pass that found nothing it would most often find
        nothing again. So the next passes only ask whether a claim or the
        housekeeping has anything to do now (``claim.idle_probe_ms``), until it
        has, a notification wakes the loop, or ``IDLE_FULL_ROUND_S`` passed since
        the last full pass (for what the probe does not read: a dead worker's AI
        task, stale rendezvous rows).
        """
        if time.monotonic() - self._last_full >= IDLE_FULL_ROUND_S:
            return None
        due = claim.idle_probe_ms(
            self.using,
            workflows=self.selection.workflows(),
            app_ids=self.app_ids,
            queues=self.selection.queues,
            providers=list(ai.providers()),
        )
        self.stats["idle_probes"] += 1
        if self.health:
            self.health.touch()
        if due is not None and due <= 0:
            return None
        return math.inf if due is None else due

    def _sleep(self, poll: float, due_ms: float | None) -> None:
        """Wait for a notification, the next due run or deadline, a schedule tick or a poll."""
        timeout = poll
        if due_ms is not None:
            timeout = min(timeout, max(due_ms / 1000, 0.005))
        if self.schedule_passes.enabled:
            next_check = self.schedule_passes.next_check
            timeout = min(timeout, max(next_check - time.monotonic(), 0.005))
        self._start_listener()
        self._woken = self.wake.wait(timeout)

    def _weather(self, where: str, exc: Exception, backoff: weather.Backoff) -> None:
        """A failed pass of the loop: close the connection, log one line, back off, carry on.

        A worker that exits on a database error leaves its runs to lease expiry
        and needs a supervisor to come back: it is the process, not the run, that
        must outlive a restart or a failover.
        """
        delay = backoff.next()
        weather.close_quietly(self.using)
        self.connections.orphans_possible = True
        if weather.is_connection_error(exc):
            self.stats["reconnects"] += 1
            metrics.count_db_reconnect("loop")
            logger.warning(
                "%s: database unavailable: %s; reconnecting in %.1f s",
                where,
                weather.describe(exc),
                delay,
            )
        else:
            logger.exception("%s: unexpected error; retrying in %.1f s", where, delay)
        self.stopping.wait(delay)

    def _fill(self, pool: ThreadPoolExecutor) -> int:
        """Top up the local queue and start idle threads on it; returns how many were claimed.

        The queue is topped up only when a thread is idle or it runs low, so
        that one claim (one commit) serves several runs.
        """
        if time.monotonic() < self.runner.claims_paused_until:
            return 0
        if not self.keeper.ready and not self.keeper.connect():
            # Nothing claimed may go unrenewed: wait for the keeper's connection.
            if not self._keeper_waiting:
                logger.warning(
                    "worker %s: the lease keeper has no database connection; "
                    "claiming nothing until it has one",
                    self.worker_id,
                )
            self._keeper_waiting = True
            return 0
        self._keeper_waiting = False
        with self._lock:
            free = self.concurrency - len(self.claims.inflight)
            queued = len(self.claims.ready)
        claimed = 0
        ahead = self.prefetch.current
        if free > queued or queued <= ahead // 4:
            asked = free + ahead - queued
            runs, loaded, tasks = self.claim(asked, task_slots=max(0, free - queued))
            self.prefetch.claimed(asked, len(runs))
            self.claims.queue(runs, loaded)
            for task in tasks:
                self.claims.submit(pool, self.runner.execute_task, task)
                free -= 1
            claimed = len(runs) + len(tasks)
        with self._lock:
            start = min(free, len(self.claims.ready))
        for _ in range(start):
            self.claims.submit(pool, self.runner.run_queued)
        return claimed

    # -- the parts' entry points that callers (the test helpers, tests) use ----

    def claim(
        self, limit: int, *, task_slots: int | None = None
    ) -> tuple[list[tuple[uuid.UUID, int]], dict[uuid.UUID, Preloaded], list]:
        """Claim runs, read their state, and claim AI tasks: ``Claims.claim``."""
        return self.claims.claim(limit, task_slots=task_slots)

    def fire_schedules(self, *, force: bool = False) -> int:
        """Fire the due ticks of this worker's workflows: ``SchedulePasses.fire``."""
        return self.schedule_passes.fire(force=force)

    def in_flight(self) -> int:
        """Runs and AI tasks this process is executing now."""
        return self.claims.in_flight()
