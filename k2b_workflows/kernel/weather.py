"""Database weather: lost connections are waited out, never allowed to kill a worker.

A restart (``pg_ctl restart``), a failover, ``pg_terminate_backend``, an
idle-session timeout or a connection limit all reach the worker as an
``OperationalError`` or ``InterfaceError`` from whatever statement it was
running. None of them says anything about the run being executed: the
connection is closed, one line is logged, the loop backs off with jitter
(so that a fleet does not reconnect in lockstep) and carries on. A step whose
connection died in flight takes the unknown-commit path (``db.CommitOutcomeUnknown``):
its journal, which commits in that very transaction, tells on the next claim.

Conflicts (40001, 40P01, 55P03, 57014) are ``OperationalError`` too, but the
connection survives them: they are retried by ``db.run_in_transaction``, not here.
"""

from __future__ import annotations

import contextlib
import random
import select
from dataclasses import dataclass, field

from django.db import DatabaseError, connections
from django.db import InterfaceError as DjangoInterfaceError
from django.db import OperationalError as DjangoOperationalError

from . import db

# SQLSTATEs that end or refuse a session. Class 08 is "connection exception".
_SESSION_ENDED = frozenset(
    {
        "57P01",  # admin_shutdown: pg_terminate_backend, pg_ctl restart/stop -m fast
        "57P02",  # crash_shutdown: another backend crashed, or -m immediate
        "57P03",  # cannot_connect_now: the server is starting up or shutting down
        "57P05",  # idle_session_timeout
        "25P03",  # idle_in_transaction_session_timeout (frozen inside a transaction)
        "53300",  # too_many_connections (max_connections, a role's or a database's limit)
        "53000",  # insufficient_resources
        "58000",  # system_error (e.g. the server ran out of file descriptors)
    }
)


def is_connection_error(exc: BaseException) -> bool:
    """True when ``exc`` means "the connection is gone or cannot be had", not "the SQL failed"."""
    state = db.sqlstate(exc)
    if state is not None:
        return state in _SESSION_ENDED or state.startswith("08")
    # Without an SQLSTATE: psycopg's own errors (closed socket, connect failure),
    # which Django re-raises as its OperationalError or InterfaceError.
    import psycopg

    chain: BaseException | None = exc
    while chain is not None:
        if isinstance(
            chain,
            DjangoOperationalError
            | DjangoInterfaceError
            | psycopg.OperationalError
            | psycopg.InterfaceError,
        ):
            return True
        chain = chain.__cause__ or chain.__context__
    return False


def close_quietly(using: str) -> None:
    """Drop this thread's Django connection, whatever state it is in.

    Django refuses to reconnect a connection that died inside ``atomic`` until
    it is closed; a broken connection may also raise on ``close()`` itself.
    """
    with contextlib.suppress(DatabaseError):
        connections[using].close()


def hung_up(using: str) -> bool:
    """True when the server already ended this thread's idle connection.

    A backend terminated (or a server restarted) while the connection sat
    idle between runs leaves a FATAL message or an EOF unread on its socket.
    Checking the socket costs one ``select`` and no round trip, and saves
    starting a run on a connection whose first statement must fail.
    """
    conn = connections[using]
    raw = conn.connection
    if raw is None or conn.in_atomic_block:
        return False
    try:
        readable, _, _ = select.select([raw.fileno()], [], [], 0)
    except Exception:  # closed or unusable: as good as hung up
        return True
    return bool(readable)


def describe(exc: BaseException) -> str:
    """One line: the first line of the server's message, with its SQLSTATE when known."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    state = db.sqlstate(exc)
    return f"{text} [{state}]" if state else text


@dataclass
class Backoff:
    """Capped exponential backoff with jitter: each delay is drawn from [step / 2, step].

    The jitter spreads a fleet that lost its database at the same instant over
    the whole interval, so the restarted server is not hit by every worker at once.
    """

    first: float = 0.1
    cap: float = 5.0
    attempts: int = field(default=0, init=False)

    def next(self) -> float:
        self.attempts += 1
        ceiling = min(self.cap, self.first * 2 ** min(self.attempts - 1, 30))
        return random.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.attempts = 0
