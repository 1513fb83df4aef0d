"""The LISTEN that wakes a worker: a notification of its apps sets the loop's ``wake``.

It has an autocommit psycopg connection of its own: a pooled Django connection
would go on listening for its next borrower. Whatever is committed while it is
not listening (before it connects, after a lost connection) is found by the
loop's polling; each reconnection wakes the loop once for that reason.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence

from .. import metrics, settings
from ..kernel import db, waits, weather

logger = logging.getLogger(__name__)


_LISTEN_SQL = f"LISTEN {settings.CHANNEL}"


class Listener(threading.Thread):
    """LISTENs on the workers' channel and sets ``wake`` for notifications of our apps.

    And for ``waits.EVERY_APP``: a resumed queue's runs may be any app's (#49). A
    running run asked to stop (``waits.CANCEL_NOTICE``, #49) is handed to ``on_cancel``
    (the lease keeper's ``look_now``), which looks at once if the run is ours."""

    #: How long one wait for notifications lasts: the longest ``stop()`` waits for the thread.
    WAIT_S = 0.1

    def __init__(
        self,
        using: str,
        app_ids: Sequence[str] | None,
        wake: threading.Event,
        on_cancel: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(name="k2b-listener", daemon=True)
        self.using = using
        self.app_ids = set(app_ids or ())
        self.wake = wake
        self.on_cancel = on_cancel
        self.stopping = threading.Event()
        self.connected = threading.Event()
        self.received = 0

    def run(self) -> None:
        backoff = weather.Backoff()
        while not self.stopping.is_set():
            conn = None
            try:
                conn = db.autocommit_connection(self.using, follow_clock=False)
                conn.execute(_LISTEN_SQL)
                self.connected.set()
                backoff.reset()
                # Anything committed while we were not listening is found by polling.
                self.wake.set()
                while not self.stopping.is_set():
                    for note in conn.notifies(timeout=self.WAIT_S):
                        if note.payload.startswith(waits.CANCEL_NOTICE):
                            if self.on_cancel is not None:
                                self.on_cancel(note.payload[len(waits.CANCEL_NOTICE) :])
                            if note.payload not in self.app_ids:
                                continue
                        if (
                            not self.app_ids
                            or note.payload in self.app_ids
                            or note.payload == waits.EVERY_APP
                        ):
                            self.received += 1
                            self.wake.set()
            except Exception as exc:
                self.connected.clear()
                metrics.count_db_reconnect("listener")
                delay = backoff.next()
                logger.warning(
                    "listener: %s; polling, reconnecting in %.1f s", weather.describe(exc), delay
                )
                self.stopping.wait(delay)
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()

    def stop(self) -> None:
        self.stopping.set()
