"""Whether the worker that held a run may still be inside its call.

The failure this is built around (#47): a lease is only a promise to renew.
A live worker starved past its lease, an action slower than its timeout, or
a runtime role that rewrites ``lease_expires_at`` made a run look abandoned
while its holder was still inside an EXTERNAL ``run()``. The takeover then
asked ``reconcile()``, the provider had not seen the call yet and said
"absent", and the run ended FAILED for a charge that happened: the holder's
real answer came back a moment later and was only evidence. A run ended under
its holder (a cancel) likewise gave its concurrency slot up when its lease
was rewritten, and the next run of a limit-1 key entered the provider beside
it.

A lease says nothing about the process; these say whether it is there:

- its **presence lock**: every worker holds a session advisory lock named
  after its id (``PRESENCE_LOCK``) on its lease keeper's connection, which
  it opens on ``LISTEN_DATABASE`` (a direct or session-pooled connection, as
  LISTEN itself needs: docs/operations.md#pgbouncer; through a transaction
  pooler a session lock would stay on a server connection after the worker).
  PostgreSQL drops it the moment the connection goes: a killed process
  (SIGKILL, OOM, a lost host) loses it at once, a stopped one (SIGSTOP, a
  long pause, a starved host) keeps it. Nobody else can drop it, the
  runtime role included;
- its **heartbeat** (``k2b_worker``), fresh within ``worker_fresh_ms()``: the
  fallback while the keeper has no connection or could not take the lock.

Either keeps the holder present. Only the takeover path asks: a claim and a
step never do.

Present is not yet inside the call. After a failover to an asynchronous
standby the new primary's ledger may end with a "dispatched" entry whose
answer its worker wrote to the old primary only: the worker is alive, long
out of that call, and a takeover that waited for it waited for ever (and
the worker, claiming the run itself, waited for itself). So a worker also
says which calls it is inside: its keeper holds a **call lock**
(``CALL_LOCK``, the worker and the run) from before the dispatch commits
until ``run()`` has returned, and, once it holds the lock of every call it
is inside, its **reporting lock** (``REPORTING_LOCK``). A takeover that finds
the reporting lock held asks the call lock alone; without it (a keeper
reconnecting, a pooler, a worker of an older release that takes no call
locks) presence decides, as above: a wait too long, never a race.
"""

from __future__ import annotations

from typing import Any

from django.db import connections

from .. import settings
from ..triggers import PRESENCE_LOCK

__all__ = [
    "CALL_LOCK",
    "IN_CALL",
    "LOCK_CALL_SQL",
    "PRESENCE_LOCK",
    "REPORTING_LOCK",
    "TAKE_PRESENCE_SQL",
    "TAKE_REPORTING_SQL",
    "UNLOCK_CALL_SQL",
    "calls_sql",
    "inside",
    "present",
    "still_in_call",
]

#: Sent by the lease keeper on its connection: the lock is held until that connection goes.
#: Only where the connection reaches PostgreSQL itself (the port we dialled is the one
#: it listens on, or a Unix socket): behind a pooler or a proxy the session lock could
#: stay on a server connection after us, and a dead worker would look present for
#: ever. NULL there: the heartbeat alone tells.
TAKE_PRESENCE_SQL = (
    "SELECT CASE WHEN pg_catalog.inet_server_port() IS NULL"
    " OR pg_catalog.inet_server_port() = %s"
    " THEN pg_catalog.pg_try_advisory_lock({}) END".format(PRESENCE_LOCK.format(worker="%s"))
)


#: Held by a worker's keeper connection once it holds the call lock of every call its
#: worker is inside: then, and only then, a free call lock means "not in that call".
#: ``{worker}``: an SQL text expression of the worker's id.
REPORTING_LOCK = "pg_catalog.hashtextextended('k2b.calls:' || {worker}, 0)"

#: Held by a worker's keeper connection while the worker is inside an external call
#: of the run: from before its dispatch commits until ``run()`` has returned.
#: ``{worker}``, ``{run}``: SQL text expressions of the worker's and the run's ids.
CALL_LOCK = "pg_catalog.hashtextextended('k2b.call:' || {worker} || ':' || {run}, 0)"

#: Sent by the keeper, after the call locks, when it holds the presence lock directly.
TAKE_REPORTING_SQL = "SELECT pg_catalog.pg_try_advisory_lock({})".format(
    REPORTING_LOCK.format(worker="%s")
)

#: A call lock, waited for: a takeover holds it only for its own short transaction.
LOCK_CALL_SQL = "SELECT pg_catalog.pg_advisory_lock({})".format(
    CALL_LOCK.format(worker="%s", run="%s::uuid::text")
)

UNLOCK_CALL_SQL = "SELECT pg_catalog.pg_advisory_unlock({})".format(
    CALL_LOCK.format(worker="%s", run="%s::uuid::text")
)


def calls_sql(lock: bool, unlocks: int) -> str:
    """One statement that takes a call lock (``lock``) and gives ``unlocks`` back: the
    keeper gives a finished call's lock back with its next call's, one round trip a
    call rather than two (or at its next tick, if no call comes first). Parameters:
    the worker and the run of each, the lock's first."""
    one = CALL_LOCK.format(worker="%s", run="%s::uuid::text")
    parts = [f"pg_catalog.pg_advisory_lock({one})"] if lock else []
    parts += [f"pg_catalog.pg_advisory_unlock({one})"] * unlocks
    return "SELECT " + ", ".join(parts)


def present(worker: str, fresh_ms: str = "%s") -> str:
    """SQL true when the worker ``worker`` (an SQL expression of its id) may be running.

    ``fresh_ms``: how old its heartbeat may be (a placeholder by default). The
    lock is only tried (``pg_try_advisory_xact_lock``): taken, it is ours until
    our transaction ends, and the holder, gone, never wanted it back.
    """
    lock = PRESENCE_LOCK.format(worker=worker)
    return (
        f"({worker} <> '' AND (EXISTS (SELECT 1 FROM k2b_worker hw"
        f" WHERE hw.worker_id = {worker} AND hw.state = 'alive'"
        f" AND hw.heartbeat_at >= k2b_now() - {fresh_ms} * interval '1 millisecond')"
        f" OR NOT pg_catalog.pg_try_advisory_xact_lock({lock})))"
    )


#: SQL true when the run ``k`` is inside an external call of its current holder: its
#: ledger ends with a dispatch of the generation that holds it. Nothing after a
#: dispatch but the call's own answer, so nothing else can stand last.
IN_CALL = """COALESCE((SELECT l.kind = 'dispatched' AND l.generation = k.generation
    FROM k2b_ledger l WHERE l.run_id = k.id ORDER BY l.id DESC LIMIT 1), false)"""


def inside(worker: str, run: str, fresh_ms: str = "%s") -> str:
    """SQL true when the worker ``worker`` may be inside an external call of the run ``run``.

    A worker that reports its calls (its reporting lock is held) is inside the
    call when its call lock is held; any other is when it is ``present``. The
    CASE decides the order: the reporting lock is asked first.
    """
    reporting = REPORTING_LOCK.format(worker=worker)
    call = CALL_LOCK.format(worker=worker, run=run)
    return (
        f"(CASE WHEN {worker} <> '' AND NOT pg_catalog.pg_try_advisory_xact_lock({reporting})"
        f" THEN NOT pg_catalog.pg_try_advisory_xact_lock({call})"
        f" ELSE {present(worker, fresh_ms)} END)"
    )


#: The worker that dispatched an invocation (its dispatch entry names it), if it may
#: still be inside that call: nothing of that invocation was recorded since (every
#: entry after a dispatch is written once ``run()`` has returned: its late result,
#: its "outcome unknown", a reconcile's answer or poll), and it is inside it.
_STILL_IN_CALL_SQL = f"""
SELECT d.worker FROM (
    SELECT l.id, l.detail->>'worker' AS worker FROM k2b_ledger l
     WHERE l.run_id = %s AND l.seq = %s AND l.kind = 'dispatched' AND l.invocation_key = %s
     ORDER BY l.id DESC LIMIT 1) d
 WHERE d.worker IS NOT NULL
   AND NOT EXISTS (SELECT 1 FROM k2b_ledger a
                    WHERE a.run_id = %s AND a.seq = %s AND a.id > d.id
                      AND a.invocation_key = %s)
   AND {inside("d.worker", "%s::uuid::text")}
"""


def still_in_call(using: str, run_id: Any, seq: int, invocation_key: str) -> str | None:
    """The id of the worker that may still be inside the call ``invocation_key``, or None.

    Asked by a takeover before it reconciles (the replay of an open dispatch):
    whoever took the run (a reaper of an older release, the runtime role setting
    the status back to ``queued``), the call is not raced (#47).
    """
    params = [run_id, seq, invocation_key, run_id, seq, invocation_key, run_id]
    params.append(settings.worker_fresh_ms())
    with connections[using].cursor() as cursor:
        cursor.execute(_STILL_IN_CALL_SQL, params)
        row = cursor.fetchone()
    return row[0] if row else None
