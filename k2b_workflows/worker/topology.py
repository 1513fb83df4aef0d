"""What the database in front of the workers is: a primary with which standbys, behind which pooler.

Evidence is only as durable as its commit. With a synchronous standby a
failover loses no committed ledger entry, so it repeats no effect. With
asynchronous standbys the last commits before a failover can be lost, and a
lost "dispatched" entry means the kernel dispatches that effect again. The
worker says at start which setup it is on (``replication``), and a system
check (``k2b_workflows.W020``, silenceable) warns about the asynchronous one.

A transaction-pooling PgBouncer breaks two things the docs name: ``LISTEN``
(a notification reaches whichever client holds the server connection, usually
nobody) and the per-session ``idle_in_transaction_session_timeout`` (it lands on
a shared server connection). ``pooler_problems`` finds both by sending itself a
notification through each alias: through a transaction pooler it never arrives.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass

from django.db import connections

#: The system check that warns about a primary with asynchronous standbys.
ASYNC_STANDBY_CHECK = "k2b_workflows.W020"

#: How long a probe notification may take before the alias is taken for a transaction pooler.
PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Replication:
    """The replication setup of the database behind one alias, as its primary sees it."""

    #: "synchronous", "asynchronous", "single" (no streaming standby seen) or "standby".
    kind: str
    #: Streaming standbys connected to this server (``pg_stat_replication``).
    standbys: int
    #: ``synchronous_standby_names`` as set, "" when unset.
    synchronous_names: str

    @property
    def repeats_possible(self) -> bool:
        """Whether a failover can lose a committed "dispatched" entry (and repeat its effect)."""
        return self.kind == "asynchronous"

    def describe(self) -> str:
        if self.kind == "synchronous":
            return (
                f"primary with a synchronous standby (synchronous_standby_names = "
                f"{self.synchronous_names!r}, {self.standbys} standby(s) streaming): "
                "a failover to a synchronous standby loses no commit"
            )
        if self.kind == "asynchronous":
            return (
                f"primary with {self.standbys} asynchronous standby(s) and no synchronous one: "
                "a failover can lose the last commits, and an EXTERNAL effect dispatched in "
                "those moments can be dispatched again"
            )
        if self.kind == "standby":
            return "a standby in recovery (read-only): workers need the primary"
        return (
            "single node (no streaming standby connected; replication below PostgreSQL, "
            "such as a managed service's storage-level standby, is not visible here)"
        )


_REPLICATION_SQL = """
SELECT pg_is_in_recovery(),
       current_setting('synchronous_standby_names'),
       current_setting('synchronous_commit'),
       (SELECT count(*) FROM pg_stat_replication)
"""


def replication(alias: str) -> Replication:
    """Ask the server behind ``alias`` which standbys it has (one round trip)."""
    with connections[alias].cursor() as cursor:
        cursor.execute(_REPLICATION_SQL)
        in_recovery, names, commit, standbys = cursor.fetchone()
    names = (names or "").strip()
    if in_recovery:
        kind = "standby"
    elif names and commit not in ("off", "local"):
        kind = "synchronous"
    elif standbys:
        kind = "asynchronous"
    else:
        kind = "single"
    return Replication(kind=kind, standbys=int(standbys), synchronous_names=names)


#: The probe's channel is a name of its own (``k2b_probe_<hex>``): no one else's wake-up.
_LISTEN_SQL = "LISTEN {}"
_PROBE_NOTIFY_SQL = "SELECT pg_notify(%s, '')"


def notifications_arrive(alias: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a notification sent on ``alias`` reaches a session LISTENing on ``alias``.

    The listening connection and the sending one are two autocommit
    connections; directly or through a session pooler the notification
    arrives within milliseconds, through a transaction pooler never (the
    LISTEN stays on a server connection no client holds).
    """
    from ..kernel import db

    channel = f"k2b_probe_{uuid.uuid4().hex[:12]}"
    listener = db.autocommit_connection(alias, follow_clock=False)
    try:
        listener.execute(_LISTEN_SQL.format(channel))
        sender = db.autocommit_connection(alias, follow_clock=False)
        try:
            sender.execute(_PROBE_NOTIFY_SQL, [channel])
        finally:
            sender.close()
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            for note in listener.notifies(timeout=min(left, 0.5)):
                if note.channel == channel:
                    return True
        return False
    finally:
        with contextlib.suppress(Exception):
            listener.close()


_IDLE_TIMEOUT_DEFAULT_SQL = (
    "SELECT reset_val::bigint FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout'"
)


def _role_idle_timeout_ms(alias: str) -> int:
    """The ``idle_in_transaction_session_timeout`` a fresh session starts with (role, database,
    server), in milliseconds: what protects a pooled server connection, whatever a session sets."""
    with connections[alias].cursor() as cursor:
        cursor.execute(_IDLE_TIMEOUT_DEFAULT_SQL)
        return int(cursor.fetchone()[0])


def pooler_problems(alias: str, listen_alias: str | None, lease_ms: int) -> list[str]:
    """The transaction-pooler misconfigurations of docs/operations.md#pgbouncer, named.

    ``listen_alias`` is None when the worker does not listen. Each probe costs
    two short connections; a pooled alias costs ``PROBE_TIMEOUT_S`` of waiting.
    """
    problems = []
    pooled: dict[str, bool] = {}
    if listen_alias is not None:
        pooled[listen_alias] = not notifications_arrive(listen_alias)
        if pooled[listen_alias]:
            problems.append(
                f"LISTEN through a transaction pooler: a notification sent on database "
                f"{listen_alias!r} did not come back in {PROBE_TIMEOUT_S:.0f} s, so wake-ups "
                "come only at the pace of POLL_INTERVAL_MS; point K2B_WORKFLOWS['LISTEN_DATABASE']"
                " at a direct connection (or a session-mode pool)"
            )
    if alias not in pooled:
        pooled[alias] = not notifications_arrive(alias)
    if pooled[alias]:
        role_ms = _role_idle_timeout_ms(alias)
        if role_ms == 0 or role_ms > lease_ms:
            shown = f"{role_ms} ms" if role_ms else "0 (off)"
            problems.append(
                f"idle_in_transaction_session_timeout on a pooled connection: database {alias!r} "
                "pools by transaction, so the one-lease timeout this worker sets per session lands"
                f" on a shared server connection, and the role's own is {shown}; set it on the "
                f"role: ALTER ROLE <role> SET idle_in_transaction_session_timeout TO "
                f"'{lease_ms}ms'"
            )
    return problems
