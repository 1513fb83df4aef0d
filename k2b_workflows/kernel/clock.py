"""The kernel's one clock: the database's time, plus an offset that only tests set.

The failure this is built around: the kernel reads time in SQL (lease expiry,
retry backoff, wait deadlines, claims) and in Python (deadlines computed from
a ``timedelta``, action timeouts). A test that moves one of them (freezegun
moves Python, nothing moves ``statement_timestamp()``) sees a deadline pass on
one clock and not on the other. So every read goes through one of two doors
that add the same offset: ``k2b_now()`` in SQL and ``now()`` / ``monotonic()``
here.

The second failure (#35): the offset is a session setting
(``k2b.clock_offset``), and any session may set any such setting. As the
runtime role, ``set_config('k2b.clock_offset', '86400 seconds', false)``
moved ``k2b_now()`` a day; through a transaction pooler it stayed on the
server connection and the workers that got it next fired tomorrow's tick
today. So ``k2b_now()`` as migrated (0020) is ``statement_timestamp()`` and
reads no setting at all; only the owner of the function can give it the body
that adds the offset (``honour_offset``), which
``k2b_workflows.testing.controlled_clock()`` does on the test database for as
long as a test's clock runs, and undoes after.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
import time
import weakref
from typing import Any

from django.utils import timezone

#: The session setting ``k2b_now()`` adds to ``statement_timestamp()``.
SETTING = "k2b.clock_offset"
SET_SQL = "SELECT set_config('k2b.clock_offset', %s, false)"

#: ``k2b_now()`` as production runs it: the statement's timestamp, no setting read.
REAL_SQL = """
CREATE OR REPLACE FUNCTION k2b_now() RETURNS timestamptz
LANGUAGE plpgsql STABLE PARALLEL SAFE COST 1
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN pg_catalog.statement_timestamp();
END;
$$;
"""
#: ``k2b_now()`` while a test's clock runs: plus the session's ``k2b.clock_offset``.
OFFSET_SQL = """
CREATE OR REPLACE FUNCTION k2b_now() RETURNS timestamptz
LANGUAGE plpgsql STABLE PARALLEL SAFE COST 1
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN pg_catalog.statement_timestamp()
           + COALESCE(
               NULLIF(pg_catalog.current_setting('k2b.clock_offset', true), ''),
               '0')::interval;
END;
$$;
"""

_ZERO = dt.timedelta(0)
_offset = _ZERO
_offset_s = 0.0
_lock = threading.Lock()
#: psycopg connections that follow the clock: the kernel's own autocommit
#: connections (registered when opened) and Django's while a test clock runs.
_followers: weakref.WeakSet[Any] = weakref.WeakSet()


def now() -> dt.datetime:
    """The kernel's current time (aware): ``timezone.now()`` plus the test offset."""
    return timezone.now() + _offset


def monotonic() -> float:
    """``time.monotonic()`` plus the test offset, for timeouts measured in this process."""
    return time.monotonic() + _offset_s


def offset() -> dt.timedelta:
    """How far tests have moved the clock ahead of real time (zero in production)."""
    return _offset


def setting_value(offset: dt.timedelta) -> str:
    """``offset`` as ``k2b.clock_offset`` holds it: whole seconds and a fraction.

    No ``days`` unit: a day added to a ``timestamptz`` is a calendar day in the
    session's time zone (23 or 25 hours across DST), the Python side adds 24.
    The empty string is "no offset".
    """
    if not offset:
        return ""
    seconds = offset.days * 86_400 + offset.seconds
    return f"{seconds}.{offset.microseconds:06d} seconds"


def _apply(conn: Any, value: str) -> None:
    """Set the offset on one psycopg connection (idle, autocommit: it sticks)."""
    conn.execute(SET_SQL, [value])


def follow(conn: Any) -> None:
    """Make a new psycopg connection follow the clock (``db.autocommit_connection``).

    Costs nothing while the offset is zero, that is always in production.
    """
    with _lock:
        _followers.add(conn)
        if _offset:
            _apply(conn, setting_value(_offset))


def set_offset(new: dt.timedelta, extra: list[Any] | tuple[Any, ...] = ()) -> None:
    """Move the clock to ``new`` ahead of real time, on every following connection.

    ``extra`` connections follow from now on too (the caller's Django ones).
    A connection that fails (closed, broken) is skipped: its owner reconnects,
    and a new connection takes the offset when it is opened.
    """
    global _offset, _offset_s
    with _lock:
        _offset = new
        _offset_s = new.total_seconds()
        for conn in extra:
            _followers.add(conn)
        value = setting_value(new)
        for conn in list(_followers):
            if conn.closed:
                continue
            with contextlib.suppress(Exception):
                _apply(conn, value)


def honour_offset(conn: Any, honour: bool) -> None:
    """Give ``k2b_now()`` the body that adds ``k2b.clock_offset`` (or the real one back).

    ``conn``: a psycopg connection in autocommit as the function's owner (it
    commits at once, for every session); any other role gets
    ``insufficient_privilege``: that is the point.
    """
    conn.execute(OFFSET_SQL if honour else REAL_SQL)


def forget(conns: list[Any] | tuple[Any, ...]) -> None:
    """Stop pushing the offset to ``conns`` (Django's, once the test clock is gone)."""
    with _lock:
        for conn in conns:
            _followers.discard(conn)
