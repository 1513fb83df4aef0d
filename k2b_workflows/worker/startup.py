"""A worker's start: waiting for its database, checking its schema, saying its topology.

What is refused for good (a database or role that does not exist, a failed
authentication, an unmigrated schema) raises at once; what may pass (a
database not up yet, a failover in progress) is waited out, with a line every
5 s, for as long as ``--wait-for-db`` allows. The topology probes only log,
and run beside the first claims (``say_topology_in_background``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections

from .. import settings as k2b_settings
from ..exceptions import DatabaseNotMigrated, DatabaseUnavailable
from ..kernel import db, weather

logger = logging.getLogger(__name__)

#: Words of a refused connection that waiting cannot fix: a wrong name, user or password.
_CONFIGURATION_ERRORS = ("does not exist", "authentication failed", "no password supplied")


def wait_for_database(
    using: str,
    *,
    wait_for_db: float | None,
    stopping: threading.Event,
    notice: Callable[[str], None],
) -> None:
    """Wait for the database (up to ``wait_for_db`` seconds, None: for ever, or until
    ``stopping``), then check its schema.

    Raises ``DatabaseUnavailable`` when the wait runs out, ``ImproperlyConfigured``
    for a connection refused for good, and ``DatabaseNotMigrated`` (a
    configuration error: retrying cannot help) when the app's migrations are
    not all applied. ``notice`` is told of the wait every 5 s, and of its end.
    """
    started = time.monotonic()
    backoff = weather.Backoff(first=0.5, cap=5.0)
    last_notice = -float("inf")
    while not stopping.is_set():
        try:
            # The schema check reads django_migrations: the database may go
            # away between connecting and reading it, which is weather too.
            connections[using].ensure_connection()
            db.check_migrated(using)
            break
        except DatabaseNotMigrated:
            weather.close_quietly(using)
            raise
        except DatabaseError as exc:
            if not weather.is_connection_error(exc):
                raise
            weather.close_quietly(using)
            reason = weather.describe(exc)
            if is_configuration_error(reason):
                raise ImproperlyConfigured(f"cannot connect to the database: {reason}") from exc
            waited = time.monotonic() - started
            if wait_for_db is not None and waited >= wait_for_db:
                raise DatabaseUnavailable(
                    f"database unreachable for {waited:.0f} s (--wait-for-db): {reason}"
                ) from None
            if time.monotonic() - last_notice >= 5:
                last_notice = time.monotonic()
                notice(f"waiting for the database ({waited:.0f} s so far): {reason}")
            delay = backoff.next()
            if wait_for_db is not None:
                delay = max(0.0, min(delay, wait_for_db - waited))
            stopping.wait(delay)
    if stopping.is_set():
        return
    if time.monotonic() - started > 1:
        notice("database reachable; starting")


def is_configuration_error(reason: str) -> bool:
    """A connection refused for a reason waiting cannot fix: a wrong name, user or password.

    psycopg gives no SQLSTATE for a failed connection attempt: only the
    server's message tells.
    """
    return any(marker in reason for marker in _CONFIGURATION_ERRORS)


def say_topology_in_background(worker_id: str, using: str, listen: bool) -> threading.Thread:
    """``say_topology`` in a thread: its probes take two connections and, through a
    transaction pooler, ``PROBE_TIMEOUT_S`` of waiting that no claim should."""

    def probe() -> None:
        try:
            say_topology(worker_id, using, listen)
        finally:
            connections.close_all()  # this thread's own

    thread = threading.Thread(target=probe, name="k2b-topology", daemon=True)
    thread.start()
    return thread


def say_topology(worker_id: str, using: str, listen: bool) -> None:
    """Say once which replication setup and which pooler problems this worker is on.

    A primary with only asynchronous standbys is a warning (system check
    ``k2b_workflows.W020``, which ``SILENCED_SYSTEM_CHECKS`` turns into an
    info line): a failover there can repeat an effect dispatched in its last
    moments. A failing probe is logged, never fatal: the worker runs on.
    """
    from django.conf import settings

    from . import topology

    try:
        setup = topology.replication(using)
        problems = topology.pooler_problems(
            using, k2b_settings.listen_database() if listen else None, k2b_settings.lease_ms()
        )
    except Exception as exc:
        logger.warning(
            "worker %s: could not tell the database's topology: %s",
            worker_id,
            weather.describe(exc),
        )
        return
    for problem in problems:
        logger.warning("worker %s: %s", worker_id, problem)
    # Last: once it is in the log, every line of the probes is (they run in a thread).
    silenced = topology.ASYNC_STANDBY_CHECK in getattr(settings, "SILENCED_SYSTEM_CHECKS", [])
    if setup.repeats_possible and not silenced:
        logger.warning(
            "worker %s: database %r: %s (%s)",
            worker_id,
            using,
            setup.describe(),
            topology.ASYNC_STANDBY_CHECK,
        )
    else:
        logger.info("worker %s: database %r: %s", worker_id, using, setup.describe())
