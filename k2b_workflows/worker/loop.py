"""The worker: a pool of threads executing claimed runs, woken by LISTEN, polling as a fallback.

``manage.py runworkflows`` is a thin shell around ``Worker``. Several worker
processes on several hosts share one PostgreSQL; nothing else coordinates them.

Threads:

- the main loop claims runs (and AI tasks) in batches for free slots plus a
  prefetch (``CLAIM_PREFETCH``, more on a backlog of short runs: ``prefetch.py``)
  into a local queue, starts idle pool
  threads on it, then sleeps until a notification, a free slot, a low queue,
  the next due run, or the poll interval;
- a pool thread that finishes a run starts the next queued one itself: no
  thread waits for the main loop (a claim and its reads) between runs;
- a listener on its own autocommit psycopg connection (a pooled Django
  connection would keep listening for its next borrower) sets the wake-up
  (``wakeups.py``);
- the lease keeper renews leases and notices cancellations;
- the main loop also runs schedule passes (``kernel/schedule_passes.py``) unless
  started with ``schedules=False``: it asks when the next tick fires at most
  once per ``SCHEDULE_PASS_INTERVAL_MS``, wakes for it, and fires due ticks
  in a transaction of their own, never inside a claim;
- the heartbeat keeps this process's row in the fleet table fresh
  (``fleet.py``), and, with ``metrics_port``, an HTTP thread serves metrics.

No database error ends the process (``kernel/weather.py``): every thread
closes its broken connection, logs one line, backs off with jitter and
reconnects. The process exits on SIGTERM/SIGINT (handing its runs back), or
at start-up on a configuration error (an unmigrated database, a bad URL:
``startup.py``).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, TextIO

from django.db import DatabaseError, connections, transaction

from .. import fleet, metrics, store
from ..kernel import ai, claim, db, flow, schedule_passes, waits, weather
from ..kernel.execute import Execution
from ..kernel.leases import LeaseKeeper
from ..kernel.load import Preloaded, preload, preload_statement, preloaded
from ..workflows import registered_versions
from . import startup, timeouts
from .connections import ThreadConnections, keep_or_close
from .health import HealthFile
from .prefetch import Prefetch
from .status import StatusLine, default_status_stream
from .wakeups import Listener

__all__ = ["Worker", "default_status_stream"]

logger = logging.getLogger(__name__)
#: The start and stop lines go to the package's logger by name: docs/operations.md
#: shows them as ``k2b_workflows: worker ...``, and supervisors' log filters match it.
lifecycle = logging.getLogger("k2b_workflows")


class Worker:
    """Claims and executes runs until stopped (or, with ``burst``, until nothing is left)."""

    def __init__(
        self,
        *,
        app_ids: Sequence[str] | None = None,
        concurrency: int = 1,
        burst: bool = False,
        using: str | None = None,
        worker_id: str | None = None,
        listen: bool = True,
        status_stream: TextIO | None = None,
        wait_for_db: float | None = None,
        notice_stream: TextIO | None = None,
        health_file: str | None = None,
        metrics_port: int | None = None,
        schedules: bool = True,
        queues: Sequence[str] | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.app_ids = list(app_ids) if app_ids else None
        #: ``--queue``: only task runs of these django.tasks queues (None: every run).
        self.queues = list(dict.fromkeys(queues)) if queues else None
        self.concurrency = concurrency
        self.burst = burst
        self.using = using or store.database()
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.listen = listen
        self.status_stream = status_stream
        self.stats: Counter[str] = Counter()
        self.stopping = threading.Event()
        self.wake = threading.Event()
        self.keeper = LeaseKeeper(self.using)
        #: The claim loop waits for the keeper's connection (logged once per wait).
        self._keeper_waiting = False
        self._inflight: set[Future] = set()
        #: Claimed (and preloaded) runs no thread has started yet: at most
        #: ``prefetch.current`` beyond the free threads. Their leases are renewed
        #: by the keeper; on stop they are handed back at once.
        self._ready: deque[tuple[uuid.UUID, int, Preloaded | None]] = deque()
        self.prefetch = Prefetch(store.claim_prefetch(), concurrency)
        self._lock = threading.Lock()
        self._last_housekeeping = 0.0
        #: The database's time of the last admission of keyed runs that became due.
        self._keyed_due_since: dt.datetime | None = None
        #: At start-up, give up after this many seconds without a database (None: never).
        self.wait_for_db = wait_for_db
        #: Where start-up notices go ("waiting for the database"), besides the log.
        self.notice_stream = notice_stream
        self.health = HealthFile(health_file) if health_file else None
        self.metrics_port = metrics_port
        #: Run schedule passes (``runworkflows --no-schedules``: False).
        self.schedules = schedules
        #: ``time.monotonic()`` of the next "is a tick due?" probe.
        self._next_schedule_check = 0.0
        self.heartbeat = fleet.Heartbeat(
            using=self.using,
            worker_id=self.worker_id,
            concurrency=concurrency,
            app_ids=self.app_ids,
            in_flight=self.in_flight,
        )
        #: Runs claimed by this process and not yet finished, whether waiting in
        #: ``_ready`` or executing: run id -> generation.
        self._claimed: dict[uuid.UUID, int] = {}
        #: Claimed runs a pool thread could not execute or release (no connection):
        #: the main loop hands them back with its own connection.
        self._hand_back: dict[uuid.UUID, int] = {}
        #: No claims before this ``time.monotonic()``: connections are short.
        self._claims_paused_until = 0.0
        self._shortage = weather.Backoff(first=0.2, cap=5.0)
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
        names = self._workflows()
        lifecycle.info(
            "worker %s: %d thread(s), apps %s, %d workflow version(s)%s",
            self.worker_id,
            self.concurrency,
            self.app_ids or "all",
            len(names),
            " (burst)" if self.burst else "",
        )
        self._say_unknown_apps()
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
            # what is still running when the grace period ends is handed back.
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
            self._listener = Listener(store.listen_database(), self.app_ids, self.wake)
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
        """Let steps in flight finish for up to the grace period, then hand their runs back.

        Handing back (queued, no failure counted) lets another worker continue a
        run now instead of after its lease expires. Two cases are not handed back
        at once, because this process may still commit or cause an effect:

        - a run whose row is locked by one of our step transactions (a
          TRANSACTIONAL step): it is skipped, and taken over when its lease expires
          (the server rolls the transaction back when this process exits);
        - a run whose EXTERNAL ``run()`` is in flight: it is handed back with
          ``run_after`` one lease ahead, so the provider call this process made has
          the same time to land as after a crash before anyone reconciles it, and
          the late result this thread may still write is fenced out as evidence.
        """
        # Runs claimed ahead of the threads were never started: back to the queue now.
        self._release_ready()
        grace = store.shutdown_grace_ms() / 1000
        deadline = time.monotonic() + grace
        while not self.forced.is_set():
            with self._lock:
                pending = set(self._inflight)
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            wait_futures(pending, timeout=min(left, 0.2), return_when=FIRST_COMPLETED)
        with self._lock:
            still = set(self._inflight)
        if still:
            self._hand_back_claimed()
        with self._lock:
            still = {f for f in self._inflight if not f.done()}
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
            self._hand_back_pending()
        except DatabaseError as exc:
            weather.close_quietly(self.using)
            logger.warning("could not hand back runs (%s); their leases will expire", exc)
        self._drain()
        self.connections.close_all(pool)
        pool.shutdown(wait=True)

    def _hand_back_claimed(self) -> None:
        lease = store.lease_ms()
        external = self.keeper.external_in_flight()
        with self._lock:
            held = {
                run_id: (generation, lease if run_id in external else 0)
                for run_id, generation in {**self._claimed, **self._hand_back}.items()
            }
        if not held:
            return
        try:
            with self.keeper.paused(), transaction.atomic(using=self.using):
                handed = claim.hand_back(self.using, held)
        except DatabaseError as exc:
            weather.close_quietly(self.using)
            logger.warning(
                "worker %s: could not hand back %d run(s) (%s); their leases will expire",
                self.worker_id,
                len(held),
                weather.describe(exc),
            )
            return
        with self._lock:
            for run_id in handed:
                self._hand_back.pop(run_id, None)
        self.stats["handed_back"] += len(handed)
        logger.info(
            "worker %s: handed back %d run(s) (%d after one lease: external effect in flight;"
            " %d locked by a step, left to their lease)",
            self.worker_id,
            len(handed),
            len(external & handed),
            len(held) - len(handed),
        )

    def in_flight(self) -> int:
        """Runs and AI tasks this process is executing now."""
        with self._lock:
            return len(self._inflight)

    def _show_status(self, final: bool = False) -> None:
        with self._lock:
            busy = len(self._inflight)
        self.status.show(self.status_stream, self.stats, busy, final=final)

    def stop(self, *, force: bool = False) -> None:
        """Stop claiming; running executions finish their current step and release the run.

        ``force``: do not wait for steps in flight; hand their runs back now.
        """
        self.stopping.set()
        if force:
            self.forced.set()
        self.wake.set()

    # -- the loop ------------------------------------------------------------

    def _loop(self, pool: ThreadPoolExecutor) -> None:
        poll = store.poll_interval_ms() / 1000
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
        self._hand_back_pending()
        if self.connections.orphans_possible:
            self._hand_back_orphans()
        # Claim first: housekeeping (a transaction of five statements) then overlaps
        # the first steps, and a run it makes claimable is claimed at once (wake).
        started = self._fill(pool)
        if self._housekeeping(poll) + self.fire_schedules():
            self.wake.set()
        if self.health:
            self.health.touch()
        self._show_status()
        if started:
            return False
        with self._lock:
            busy = len(self._inflight)
        if (
            self.burst
            and busy == 0
            and not self._hand_back
            and not self._ready
            and not self._pending()
        ):
            return True
        timeout = poll
        if busy < self.concurrency:
            # With every thread busy nothing can be claimed before one ends
            # (which sets ``wake``): skip the query, one commit per run saved.
            due = claim.next_due_in_ms(self.using)
            if due is not None:
                timeout = min(timeout, max(due / 1000, 0.005))
        if self.schedules:
            timeout = min(timeout, max(self._next_schedule_check - time.monotonic(), 0.005))
        self._start_listener()
        self.wake.wait(timeout)
        return False

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
        if time.monotonic() < self._claims_paused_until:
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
            free = self.concurrency - len(self._inflight)
            queued = len(self._ready)
        claimed = 0
        ahead = self.prefetch.current
        if free > queued or queued <= ahead // 4:
            asked = free + ahead - queued
            runs, loaded, tasks = self.claim(asked, task_slots=max(0, free - queued))
            self.prefetch.claimed(asked, len(runs))
            with self._lock:
                for run_id, generation in runs:
                    self._claimed[run_id] = generation
                    self.keeper.track(run_id, generation, threading.Event())
                    self._ready.append((run_id, generation, loaded.get(run_id)))
            for task in tasks:
                self._submit(pool, self._execute_task, task)
                free -= 1
            claimed = len(runs) + len(tasks)
        with self._lock:
            start = min(free, len(self._ready))
        for _ in range(start):
            self._submit(pool, self._run_queued)
        return claimed

    def _release_ready(self) -> None:
        """Hand claimed runs that no thread started back to the queue (stopping)."""
        with self._lock:
            held = [(run_id, generation) for run_id, generation, _ in self._ready]
            self._ready.clear()
            for run_id, _ in held:
                self._claimed.pop(run_id, None)
        if not held:
            return
        for run_id, _ in held:
            self.keeper.untrack(run_id)
        try:
            with self.keeper.paused(), transaction.atomic(using=self.using):
                # No thread started them: nothing of ours can still commit for them.
                released = len(claim.hand_back(self.using, {r: (g, 0) for r, g in held}))
        except DatabaseError as exc:
            weather.close_quietly(self.using)
            logger.warning(
                "could not hand back %d prefetched run(s) (%s); their leases will expire",
                len(held),
                weather.describe(exc),
            )
            return
        self.stats["released"] += released

    def claim(
        self, limit: int, *, task_slots: int | None = None
    ) -> tuple[list[tuple[uuid.UUID, int]], dict[uuid.UUID, Preloaded], list]:
        """Claim runs, read their state, and claim AI tasks for the slots left: one commit.

        ``task_slots``: how many AI tasks may be claimed at most (default: ``limit``),
        less the runs claimed.
        """
        statement = claim.claim_statement(
            self.worker_id, self._workflows(), self.app_ids, limit, self.queues
        )
        task_slots = limit if task_slots is None else task_slots
        if statement is not None and db.batches_statements(self.using):
            # The same transaction in two round trips instead of four: "BEGIN; claim",
            # then "preload; COMMIT", the ids read in between.
            runs = db.begin_and_fetch(self.using, *statement, setting=claim.CLAIM_PLAN)
            try:
                slots = task_slots - len(runs)
                tasks = ai.claim_tasks(self.using, app_ids=self.app_ids, limit=slots)
            except BaseException:
                db.rollback_quietly(self.using)
                raise
            if runs:
                ids = [run_id for run_id, _ in runs]
                rows = db.fetch_and_commit(self.using, *preload_statement(ids))
                return runs, preloaded(self.using, rows), tasks
            if tasks:
                db.commit_open(self.using)
            else:
                db.rollback_quietly(self.using)  # it claimed nothing: nothing to commit
            return runs, {}, tasks
        with transaction.atomic(using=self.using):
            runs = claim.claim_runs(
                self.using,
                worker_id=self.worker_id,
                workflows=self._workflows(),
                app_ids=self.app_ids,
                limit=limit,
                queues=self.queues,
            )
            loaded = preload(self.using, [run_id for run_id, _ in runs])
            tasks = []
            slots = task_slots - len(runs)
            if slots > 0:
                tasks = ai.claim_tasks(self.using, app_ids=self.app_ids, limit=slots)
        return runs, loaded, tasks

    def _submit(self, pool: ThreadPoolExecutor, fn: Any, *args: Any) -> None:
        future = pool.submit(fn, *args)
        with self._lock:
            self._inflight.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: Future) -> None:
        with self._lock:
            self._inflight.discard(future)
        self.wake.set()

    def _drain(self) -> None:
        while True:
            with self._lock:
                pending = list(self._inflight)
            if not pending:
                return
            for future in pending:
                future.result()

    def _hand_back_pending(self) -> None:
        """Release claimed runs that a pool thread could not execute for want of a connection.

        Not a failure of the run: no failure is counted, and the run is queued
        at once rather than left to expire as if this worker had crashed.
        """
        with self._lock:
            pending = dict(self._hand_back)
        if not pending:
            return
        with self.keeper.paused(), transaction.atomic(using=self.using):
            handed = claim.hand_back(self.using, {r: (g, 0) for r, g in pending.items()})
        with self._lock:
            for run_id in pending:
                self._hand_back.pop(run_id, None)
        if handed:
            logger.warning("database unavailable for %d claimed run(s); handed back", len(handed))

    def _hand_back_orphans(self) -> None:
        with self._lock:
            executing = list(self._claimed)
        with transaction.atomic(using=self.using):
            orphans = claim.hand_back_orphans(self.using, self.worker_id, executing)
        self.connections.orphans_possible = False
        if orphans:
            logger.warning(
                "handed back %d run(s) claimed while the database connection was lost", orphans
            )

    def _housekeeping(self, poll: float) -> int:
        """Re-queue expired leases, promote due waits, cancel overdue runs (at most
        every half poll); returns how many runs it made claimable."""
        now = time.monotonic()
        if now - self._last_housekeeping < min(poll, 0.5):
            return 0
        self._last_housekeeping = now
        with transaction.atomic(using=self.using):
            reaped = claim.reap_expired(self.using, self.worker_id, self.keeper.in_time())
            promoted = claim.promote_due_waits(self.using)
            ai.reap_expired(self.using)
            waits.purge_stale_rendezvous(self.using)
            overdue = timeouts.overdue(self.using)
            if any(d.concurrency is not None for d in registered_versions()):
                # Keyed runs started with a run_after take a slot once due (#35).
                self._keyed_due_since, admitted = flow.admit_due(self.using, self._keyed_due_since)
                promoted += admitted
        if reaped:
            logger.warning("re-queued %d run(s) whose lease expired", reaped)
        if overdue:
            self.stats["timed_out"] += timeouts.cancel_overdue(self.using, overdue)
        self.stats["reaped"] += reaped
        self.stats["deadlines"] += promoted
        return reaped + promoted

    def fire_schedules(self, *, force: bool = False) -> int:
        """Fire the due ticks of this worker's workflows; returns the runs started.

        Probes first (one indexed read), at most once per
        ``SCHEDULE_PASS_INTERVAL_MS`` unless ``force``; the next probe is
        brought forward to the next tick it learned of.
        """
        if not self.schedules:
            return 0
        now = time.monotonic()
        if not force and now < self._next_schedule_check:
            return 0
        interval = store.schedule_pass_interval_ms() / 1000
        self._next_schedule_check = now + interval
        versions: dict[str, set[int]] = {}
        for name, version in self._workflows():
            versions.setdefault(name, set()).add(version)
        if not versions:
            return 0
        started = 0
        for _ in range(10):  # bounded: claims wait meanwhile; the next call goes on
            due_in, buffered = schedule_passes.probe(self.using, sorted(versions))
            if not buffered and (due_in is None or due_in > 0):
                break
            result = schedule_passes.run_pass(self.using, versions, buffered=buffered)
            started += result.started
            self.stats["scheduled"] += result.started
            if not result.rows:
                break
        if due_in is not None and due_in > 0:
            self._next_schedule_check = min(self._next_schedule_check, now + due_in)
        return started

    def _pending(self) -> bool:
        """For ``burst``: is anything of ours queued (even delayed) or claimable soon?"""
        workflows = self._workflows()
        params: list[Any] = [[n for n, _ in workflows], [v for _, v in workflows]]
        app_filter = ""
        if self.app_ids:
            app_filter = "AND app_id = ANY(%s)"
            params.append(self.app_ids)
        if self.queues:
            app_filter += " AND queue = ANY(%s)"
            params.append(self.queues)
        with connections[self.using].cursor() as cursor:
            cursor.execute(
                f"""SELECT EXISTS (SELECT 1 FROM k2b_run
                     WHERE (workflow_name, workflow_version)
                           IN (SELECT * FROM unnest(%s::text[], %s::int[])) {app_filter}
                        AND ((status = 'queued' AND {flow.CLAIMABLE})
                             OR {flow.DELAYED_KEYED}
                             OR (status = 'running'
                                 AND lease_expires_at < k2b_now())))""",
                params,
            )
            if cursor.fetchone()[0]:
                return True
            providers = list(ai.providers())
            if not providers:
                return False
            cursor.execute(
                "SELECT EXISTS (SELECT 1 FROM k2b_ai_task WHERE status = 'queued'"
                " AND provider = ANY(%s))",
                [providers],
            )
            return bool(cursor.fetchone()[0])

    def _say_unknown_apps(self) -> None:
        """Warn of each ``--app`` that no registered workflow has, naming those that exist.

        ``runworkflows --app shpo`` (a typo) idled for ever without a word. A
        warning, not a refusal: such a worker still claims that app's AI tasks
        (a process may carry only the providers), and a fleet's command line can
        name an app before the code that defines it reaches every process (a
        rolling deploy); refusing would make those processes exit in a loop.
        """
        if not self.app_ids:
            return
        known = sorted({d.app_id for d in registered_versions()})
        for app_id in self.app_ids:
            if app_id not in known:
                lifecycle.warning(
                    "worker %s: no registered workflow has app id %r (known: %s); this worker"
                    " runs no workflow of it, only its AI tasks: a typo?",
                    self.worker_id,
                    app_id,
                    ", ".join(known) or "none",
                )

    def _workflows(self) -> list[tuple[str, int]]:
        """The (name, version) pairs this worker runs: every registered version of its apps."""
        return [
            (d.name, d.version)
            for d in registered_versions()
            if not self.app_ids or d.app_id in self.app_ids
        ]

    # -- executing (pool threads) ---------------------------------------------

    def _run_queued(self) -> None:
        """Execute queued runs one after another until the queue is empty or we stop."""
        while not self.stopping.is_set():
            with self._lock:
                if not self._ready:
                    return
                run_id, generation, loaded = self._ready.popleft()
            self.wake.set()  # the loop may top the queue up
            self._execute_run(run_id, generation, loaded)

    def _execute_run(self, run_id: uuid.UUID, generation: int, loaded: Preloaded | None) -> None:
        started = time.monotonic()
        try:
            if not self._connected(run_id, generation):
                return
            execution = Execution(
                run_id, generation, using=self.using, keeper=self.keeper, preloaded=loaded
            )
            execution.stop_requested = self.stopping
            outcome = execution.execute()
            if execution.release_pending:
                self._give_back(run_id, generation)
            with self._lock:
                self.stats["runs"] += 1
                # Its value: an Outcome key printed as <Outcome.SUCCEEDED: 'succeeded'>.
                self.stats[str(outcome)] += 1
                self.stats["steps"] += execution.steps_executed
        except Exception as exc:
            if weather.is_connection_error(exc):
                metrics.count_db_reconnect("run")
                logger.warning("run %s: database unavailable: %s", run_id, weather.describe(exc))
                weather.close_quietly(self.using)
                self._give_back(run_id, generation)
            else:
                logger.exception("run %s: unexpected error in the worker", run_id)
                self.stats["errors"] += 1
        finally:
            self.keeper.untrack(run_id)  # a dropped execution never tracked it itself
            with self._lock:
                self._claimed.pop(run_id, None)
                self.prefetch.ran(time.monotonic() - started)
            keep_or_close(self.using)

    def _connected(self, run_id: uuid.UUID, generation: int) -> bool:
        """Make sure this thread has a connection before the run's first step.

        With connections short (``max_connections``, a role's connection limit,
        a pooler's limit) the claim succeeded on the main loop's connection but
        this thread gets none: that is not the run's failure. The run goes back
        to the queue now and claims pause for a while.
        """
        if weather.hung_up(self.using):
            weather.close_quietly(self.using)
        try:
            connections[self.using].ensure_connection()
        except DatabaseError as exc:
            if not weather.is_connection_error(exc):
                raise
            weather.close_quietly(self.using)
            with self._lock:
                delay = self._shortage.next()
                self._claims_paused_until = time.monotonic() + delay
            logger.warning(
                "run %s: database unavailable: no connection for this run (%s);"
                " handing it back, claiming again in %.1f s",
                run_id,
                weather.describe(exc),
                delay,
            )
            self._give_back(run_id, generation)
            return False
        with self._lock:
            self._shortage.reset()
        return True

    def _give_back(self, run_id: uuid.UUID, generation: int) -> None:
        with self._lock:
            self._hand_back[run_id] = generation
            self.stats["handed_back"] += 1
        self.wake.set()

    def _execute_task(self, task: tuple) -> None:
        abort = threading.Event()
        task_id, generation = task[0], task[1]
        self.keeper.track_task(task_id, generation, abort)
        try:
            outcome = ai.run_task(self.using, task, abort)
            with self._lock:
                self.stats[f"ai_{outcome}"] += 1
        except Exception as exc:
            if weather.is_connection_error(exc):
                # The task's lease expires and it is queued again (the provider
                # result, if any, is lost with this claim: see kernel/ai.py).
                logger.warning(
                    "AI task %s: database unavailable: %s", task_id, weather.describe(exc)
                )
                weather.close_quietly(self.using)
            else:
                logger.exception("AI task %s: unexpected error in the worker", task_id)
        finally:
            self.keeper.untrack_task(task_id)
            keep_or_close(self.using)
