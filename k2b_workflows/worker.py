"""The worker: a pool of threads executing claimed runs, woken by LISTEN, polling as a fallback.

``manage.py runworkflows`` is a thin shell around ``Worker``. Several worker
processes on several hosts share one PostgreSQL; nothing else coordinates them.

Threads:

- the main loop claims runs (and AI tasks) in batches for free slots plus a
  small prefetch (``CLAIM_PREFETCH``) into a local queue, starts idle pool
  threads on it, then sleeps until a notification, a free slot, a low queue,
  the next due run, or the poll interval;
- a pool thread that finishes a run starts the next queued one itself: no
  thread waits for the main loop (a claim and its reads) between runs;
- a listener on its own autocommit psycopg connection (a pooled Django
  connection would keep listening for its next borrower) sets the wake-up;
- the lease keeper renews leases and notices cancellations;
- the heartbeat keeps this process's row in the fleet table fresh
  (``fleet.py``), and, with ``metrics_port``, an HTTP thread serves metrics.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TextIO

from django.db import connections, transaction
from django.db.backends.signals import connection_created

from . import fleet, metrics, store
from .health import HealthFile
from .kernel import ai, claim, db, waits
from .kernel.execute import Execution, Preloaded, preload
from .kernel.leases import LeaseKeeper
from .workflows import registered_versions

logger = logging.getLogger("k2b_workflows")


class Listener(threading.Thread):
    """LISTENs on the workers' channel and sets ``wake`` for notifications of our apps."""

    def __init__(self, using: str, app_ids: Sequence[str] | None, wake: threading.Event) -> None:
        super().__init__(name="k2b-listener", daemon=True)
        self.using = using
        self.app_ids = set(app_ids or ())
        self.wake = wake
        self.stopping = threading.Event()
        self.connected = threading.Event()
        self.received = 0

    def run(self) -> None:
        backoff = 0.1
        while not self.stopping.is_set():
            conn = None
            try:
                conn = db.autocommit_connection(self.using)
                conn.execute(f"LISTEN {store.CHANNEL}")
                self.connected.set()
                backoff = 0.1
                # Anything committed while we were not listening is found by polling.
                self.wake.set()
                while not self.stopping.is_set():
                    for note in conn.notifies(timeout=0.5):
                        if not self.app_ids or note.payload in self.app_ids:
                            self.received += 1
                            self.wake.set()
            except Exception as exc:
                self.connected.clear()
                logger.warning("listener: %s; polling until reconnected", exc)
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()

    def stop(self) -> None:
        self.stopping.set()


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
        health_file: str | None = None,
        metrics_port: int | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.app_ids = list(app_ids) if app_ids else None
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
        self._inflight: set[Future] = set()
        #: Claimed (and preloaded) runs no thread has started yet: at most
        #: ``prefetch`` beyond the free threads. Their leases are renewed by the
        #: keeper; on stop they are handed back at once.
        self._ready: deque[tuple[Any, int, Preloaded | None]] = deque()
        self.prefetch = store.claim_prefetch()
        self._lock = threading.Lock()
        self._last_housekeeping = 0.0
        self._last_status = 0.0
        self.health = HealthFile(health_file) if health_file else None
        self.metrics_port = metrics_port
        self.heartbeat = fleet.Heartbeat(
            using=self.using,
            worker_id=self.worker_id,
            concurrency=concurrency,
            app_ids=self.app_ids,
            in_flight=self.in_flight,
        )

    # -- lifecycle -----------------------------------------------------------

    def run(self) -> None:
        names = self._workflows()
        logger.info(
            "worker %s: %d thread(s), apps %s, %d workflow version(s)%s",
            self.worker_id,
            self.concurrency,
            self.app_ids or "all",
            len(names),
            " (burst)" if self.burst else "",
        )
        connection_created.connect(self._limit_idle_transactions, weak=False)
        if self.metrics_port is not None:
            port = metrics.serve(self.metrics_port, using=self.using)
            logger.info("worker %s: metrics on port %d", self.worker_id, port)
        self.heartbeat.start()
        self.keeper.start()
        listener = None
        if self.listen:
            listener = Listener(store.listen_database(), self.app_ids, self.wake)
            listener.start()
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="k2b-worker")
        try:
            self._loop(pool)
        finally:
            # Graceful: executions stop after their current step and release their runs.
            self.stopping.set()
            self._release_ready()
            self._close_thread_connections(pool)
            pool.shutdown(wait=True)
            if listener:
                listener.stop()
                listener.join(timeout=5)
            self.keeper.stop()
            self.heartbeat.stop()
            if self.health:
                self.health.remove()
            self._print_status(final=True)
            if not connections[self.using].in_atomic_block:  # e.g. call_command in a test
                connections[self.using].close()
            connection_created.disconnect(self._limit_idle_transactions)
        logger.info("worker %s stopped: %s", self.worker_id, dict(self.stats))

    def _close_thread_connections(self, pool: ThreadPoolExecutor) -> None:
        """Have every pool thread close its own connections (Django forbids closing another's).

        A barrier makes each of ``concurrency`` jobs land on a different thread.
        """
        self._drain()
        barrier = threading.Barrier(self.concurrency)

        def close() -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(timeout=5)
            connections.close_all()

        for future in [pool.submit(close) for _ in range(self.concurrency)]:
            future.result()

    def in_flight(self) -> int:
        """Runs and AI tasks this process is executing now."""
        with self._lock:
            return len(self._inflight)

    def _limit_idle_transactions(self, sender: Any, connection: Any, **kwargs: Any) -> None:
        """Let the server end a transaction this process leaves idle for longer than a lease.

        A TRANSACTIONAL step (or ``ctx.fenced()``) holds the run row lock in its
        transaction. If the process freezes there (SIGSTOP, a stuck VM), no lease
        keeper and no reaper can take the run over: the row stays locked. With this
        timeout the server rolls the transaction back and closes the session, the
        lease expires, another worker takes over, and the thawed process cannot
        commit. A TRANSACTIONAL action must therefore finish within one lease.
        """
        if connection.alias != self.using:
            return
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
                [str(store.lease_ms())],
            )

    def stop(self) -> None:
        """Stop claiming; running executions finish their current step and release the run."""
        self.stopping.set()
        self.wake.set()

    # -- the loop ------------------------------------------------------------

    def _loop(self, pool: ThreadPoolExecutor) -> None:
        poll = store.poll_interval_ms() / 1000
        while not self.stopping.is_set():
            self.wake.clear()
            self._housekeeping(poll)
            started = self._fill(pool)
            if self.health:
                self.health.touch()
            self._print_status()
            if started:
                continue
            with self._lock:
                busy = len(self._inflight)
            if self.burst and busy == 0 and not self._ready and not self._pending():
                return
            timeout = poll
            if busy < self.concurrency:
                # With every thread busy nothing can be claimed before one ends
                # (which sets ``wake``): skip the query, one commit per run saved.
                due = claim.next_due_in_ms(self.using)
                if due is not None:
                    timeout = min(timeout, max(due / 1000, 0.005))
            self.wake.wait(timeout)
        self._drain()

    def _fill(self, pool: ThreadPoolExecutor) -> int:
        """Top up the local queue and start idle threads on it; returns how many were claimed.

        The queue is topped up only when a thread is idle or it runs low, so
        that one claim (one commit) serves several runs.
        """
        with self._lock:
            free = self.concurrency - len(self._inflight)
            queued = len(self._ready)
        claimed = 0
        if free > queued or queued <= self.prefetch // 4:
            runs, loaded, tasks = self.claim(
                free + self.prefetch - queued, task_slots=max(0, free - queued)
            )
            with self._lock:
                for run_id, generation in runs:
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
        if not held:
            return
        for run_id, _ in held:
            self.keeper.untrack(run_id)
        try:
            released = claim.release_many(self.using, held)
        except Exception:
            logger.exception("could not hand back %d claimed run(s); leases will expire", len(held))
            return
        self.stats["released"] += released

    def claim(
        self, limit: int, *, task_slots: int | None = None
    ) -> tuple[list[tuple[Any, int]], dict[Any, Preloaded], list]:
        """Claim runs, read their state, and claim AI tasks for the slots left: one commit.

        ``task_slots``: how many AI tasks may be claimed at most (default: ``limit``),
        less the runs claimed.
        """
        with transaction.atomic(using=self.using):
            runs = claim.claim_runs(
                self.using,
                worker_id=self.worker_id,
                workflows=self._workflows(),
                app_ids=self.app_ids,
                limit=limit,
            )
            loaded = preload(self.using, [run_id for run_id, _ in runs])
            tasks = []
            slots = (limit if task_slots is None else task_slots) - len(runs)
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

    def _housekeeping(self, poll: float) -> None:
        now = time.monotonic()
        if now - self._last_housekeeping < min(poll, 0.5):
            return
        self._last_housekeeping = now
        with transaction.atomic(using=self.using):
            reaped = claim.reap_expired(self.using)
            promoted = claim.promote_due_waits(self.using)
            ai.reap_expired(self.using)
            waits.purge_stale_rendezvous(self.using)
        if reaped:
            logger.warning("re-queued %d run(s) whose lease expired", reaped)
        self.stats["reaped"] += reaped
        self.stats["deadlines"] += promoted

    def _pending(self) -> bool:
        """For ``burst``: is anything of ours queued (even delayed) or claimable soon?"""
        workflows = self._workflows()
        params: list[Any] = [[n for n, _ in workflows], [v for _, v in workflows]]
        app_filter = ""
        if self.app_ids:
            app_filter = "AND app_id = ANY(%s)"
            params.append(self.app_ids)
        with connections[self.using].cursor() as cursor:
            cursor.execute(
                f"""SELECT EXISTS (SELECT 1 FROM k2b_run
                     WHERE (workflow_name, workflow_version)
                           IN (SELECT * FROM unnest(%s::text[], %s::int[])) {app_filter}
                        AND (status = 'queued'
                             OR (status = 'running'
                                 AND lease_expires_at < statement_timestamp())))""",
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

    def _execute_run(self, run_id: Any, generation: int, loaded: Preloaded | None) -> None:
        try:
            execution = Execution(
                run_id, generation, using=self.using, keeper=self.keeper, preloaded=loaded
            )
            execution.stop_requested = self.stopping
            outcome = execution.execute()
            with self._lock:
                self.stats["runs"] += 1
                self.stats[outcome] += 1
                self.stats["steps"] += execution.steps_executed
        except Exception:
            logger.exception("run %s: unexpected error in the worker", run_id)
            self.stats["errors"] += 1
        finally:
            if self.keeper:
                self.keeper.untrack(run_id)  # a dropped execution never tracked it itself
            keep_or_close_connection(self.using)

    def _execute_task(self, task: tuple) -> None:
        abort = threading.Event()
        task_id, generation = task[0], task[1]
        self.keeper.track_task(task_id, generation, abort)
        try:
            outcome = ai.run_task(self.using, task, abort)
            with self._lock:
                self.stats[f"ai_{outcome}"] += 1
        except Exception:
            logger.exception("AI task %s: unexpected error in the worker", task_id)
        finally:
            self.keeper.untrack_task(task_id)
            keep_or_close_connection(self.using)

    # -- status line -----------------------------------------------------------

    def _print_status(self, final: bool = False) -> None:
        stream = self.status_stream
        if stream is None:
            return
        now = time.monotonic()
        if not final and now - self._last_status < 1.0:
            return
        self._last_status = now
        with self._lock:
            busy = len(self._inflight)
        s = self.stats
        line = (
            f"k2b worker {self.worker_id}: busy {busy}/{self.concurrency} · runs {s['runs']} · "
            f"steps {s['steps']} · succeeded {s['succeeded']} · failed {s['failed']} · "
            f"waiting {s['waiting']} · attention {s['needs_attention']} · retries {s['retry']}"
        )
        tty = getattr(stream, "isatty", lambda: False)()
        if tty:
            stream.write("\r\x1b[2K" + line + ("\n" if final else ""))
        elif final:
            stream.write(line + "\n")
        stream.flush()


def keep_or_close_connection(using: str) -> None:
    """After a run, keep the pool thread's connection unless it is broken or too old.

    Django's default ``CONN_MAX_AGE = 0`` means "one connection per request";
    a worker thread is not a request, and reconnecting for every run costs a
    backend start, the session setup and a commit, and delays every wake-up
    by several milliseconds. A positive ``CONN_MAX_AGE`` is still honoured.
    """
    conn = connections[using]
    if conn.connection is None:
        return
    if conn.settings_dict.get("CONN_MAX_AGE") != 0:
        conn.close_if_unusable_or_obsolete()
        return
    broken = conn.errors_occurred and not conn.is_usable()
    if broken or conn.in_atomic_block or conn.get_autocommit() != conn.settings_dict["AUTOCOMMIT"]:
        conn.close()
    else:
        conn.errors_occurred = False


def default_status_stream() -> TextIO | None:
    return sys.stdout if sys.stdout.isatty() else None
