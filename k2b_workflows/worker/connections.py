"""The worker's database connections: one per pool thread, each watched and bounded.

The failures this is built around: a pool thread's connection lost while it
held a claim's answer (the claim may have committed unseen: the loop must look
for orphaned runs), a frozen process holding a run row's lock forever (the
server must end a transaction left idle longer than a lease), and a
reconnect per run (Django's ``CONN_MAX_AGE = 0`` means one connection per
request, and a worker thread is not a request).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from django.db import connections
from django.db.backends.signals import connection_created

from .. import settings
from ..kernel import weather

_IDLE_TIMEOUT_SQL = "SELECT set_config('idle_in_transaction_session_timeout', %s, false)"


class ThreadConnections:
    """The connections of a worker's pool threads and of its main loop, on ``using``."""

    def __init__(self, using: str, concurrency: int, stopping: threading.Event) -> None:
        self.using = using
        self.concurrency = concurrency
        self.stopping = stopping
        #: The main loop's Django connection (``watch``).
        self.loop_connection: Any = None
        #: After a lost connection of the main loop: look for runs whose claim
        #: committed unseen (the loop clears it once it has looked).
        self.orphans_possible = False

    def on_each_thread(self, pool: ThreadPoolExecutor, fn: Callable[[], None]) -> list[Future]:
        """Submit ``fn`` once per pool thread: a barrier makes each of ``concurrency``
        jobs land on a different thread (Django's connections are per thread)."""
        barrier = threading.Barrier(self.concurrency)

        def job() -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(timeout=5)
            fn()

        return [pool.submit(job) for _ in range(self.concurrency)]

    def connect_threads(self, pool: ThreadPoolExecutor) -> None:
        """Have every pool thread open its connection now, while the loop makes its
        first claim, instead of at the start of its first run.

        Best effort: a thread that cannot connect now tries again before its
        first run (``Worker._connected``), which knows what to do about it. Nothing
        waits for these jobs; the first runs queue behind them.
        """

        def connect() -> None:
            if self.stopping.is_set():
                return
            try:
                connections[self.using].ensure_connection()
            except Exception:  # said and handled before the thread's first run
                weather.close_quietly(self.using)

        self.on_each_thread(pool, connect)

    def close_all(self, pool: ThreadPoolExecutor) -> None:
        """Have every pool thread close its own connections (Django forbids closing another's)."""
        for future in self.on_each_thread(pool, connections.close_all):
            future.result()

    def watch(self) -> None:
        """From now on, see every connection this worker opens (``connection_created``);
        the caller disconnects the receiver when the worker ends."""
        self.loop_connection = connections[self.using]
        connection_created.connect(self.connection_created, weak=False)

    def connection_created(self, sender: Any, connection: Any, **kwargs: Any) -> None:
        """A new connection to the worker's database, in any of its threads.

        One of the main loop's after start-up replaces a connection it lost.
        Not every loss reaches ``_weather``: one noticed by the ROLLBACK of an
        empty claim is closed quietly (nothing to report). Any lost connection
        may be the one a claim's answer was lost on, so the loop looks for
        orphaned runs all the same.
        """
        if connection.alias != self.using:
            return
        if connection is self.loop_connection:
            self.orphans_possible = True
        self.limit_idle_transactions(connection)

    def limit_idle_transactions(self, connection: Any) -> None:
        """Let the server end a transaction this process leaves idle for longer than a lease.

        A TRANSACTIONAL step (or ``ctx.fenced()``) holds the run row lock in its
        transaction. If the process freezes there (SIGSTOP, a stuck VM), no lease
        keeper and no reaper can take the run over: the row stays locked. With this
        timeout the server rolls the transaction back and closes the session, the
        lease expires, another worker takes over, and the thawed process cannot
        commit. A TRANSACTIONAL action must therefore finish within one lease.
        """
        with connection.cursor() as cursor:
            cursor.execute(
                _IDLE_TIMEOUT_SQL,
                [str(settings.lease_ms())],
            )

    def unwatch(self) -> None:
        connection_created.disconnect(self.connection_created)


def keep_or_close(using: str) -> None:
    """After a run, keep the pool thread's connection unless it is broken or too old.

    Django's default ``CONN_MAX_AGE = 0`` means "one connection per request";
    a worker thread is not a request, and reconnecting for every run costs a
    backend start, the session setup and a commit, and delays every wake-up
    by as much. A positive ``CONN_MAX_AGE`` is still honoured.
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
