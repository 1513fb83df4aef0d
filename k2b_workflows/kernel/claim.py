"""Claiming runs, the fence number, and what happens when a lease runs out.

A claim is one set-based statement over ``FOR UPDATE SKIP LOCKED``: claimers
never wait for each other and never claim the same run. Each claim raises
``generation``; that number is the fence every later write of the claimer
checks under the run lock.

The runs to claim are picked by a subquery read once, as an array (an
InitPlan). Written ``r.id IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)`` it
may be planned as a semi join that runs the subquery again for every row of
``k2b_run``: each pass skips the runs the statement already updated and locks
the next ones, so a claim of 4 took 5 to 7 runs (and read the queue 20,000
times) on statistics that predated a bulk enqueue (#38).

Claims walk ``k2b_run_queued`` in line order (``kernel/flow.py``): a run's
``run_after`` less its priority's credit, which for the runs of priority 0
is ``run_after`` itself. The walk is bounded by ``k2b_now()`` (a due run's line
order is never later than now) and reads none of the runs queued behind a
busy concurrency key: they are not in the index until admitted.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from django.db import connections

from .. import counters, settings
from . import batches, db, flow, holders
from .requeue import AFTER_MS, requeue_set

logger = logging.getLogger(__name__)

_CLAIM_SQL = """
WITH claimed AS (
UPDATE k2b_run r
   SET status = 'running',
       generation = r.generation + 1,
       lease_expires_at = k2b_now() + %s * interval '1 millisecond',
       claimed_by = %s,
       updated_at = k2b_now()
 WHERE r.id = ANY(ARRAY(
        SELECT id FROM k2b_run
         WHERE status = 'queued' AND {claimable} AND {not_paused}
           AND {line} <= k2b_now() AND run_after <= k2b_now(){selection}
         ORDER BY {line}
         LIMIT %s
           FOR UPDATE SKIP LOCKED))
RETURNING r.id, r.generation,
          COALESCE(r.fair_line, r.run_after) - r.priority_credit_ms * interval '1 millisecond'
          AS line)
SELECT id, generation FROM claimed ORDER BY line
"""

#: Sent before the claim, in its transaction. The claim should walk the queued
#: runs' index in line order and stop after ``limit`` rows; PostgreSQL does so
#: only if its statistics say many runs are queued. Right after a bulk enqueue
#: into a table it has not analyzed since, it expects a handful, and any way of
#: finding queued runs costs about what the walk in line order costs: it read
#: every queued run into a bitmap, or through another index
#: (``k2b_run_queued_queue``, a project's own), and sorted them, at every claim
#: (docs/performance.md, "Scaling out", has the figures). Without sorts, only
#: the walk in line order is left. Before PostgreSQL 18 a disabled sort (the
#: claimed rows' own, which has no alternative) adds its penalty to the cost,
#: which then passes ``jit_above_cost``: each claim spent 300 ms compiling.
#: Hence no JIT either. One statement, so that it goes in a pipeline of
#: prepared statements too; both settings end with the transaction.
CLAIM_PLAN = (
    "SELECT pg_catalog.set_config('enable_sort', 'off', true),"
    " pg_catalog.set_config('jit', 'off', true)"
)


def claim_runs(
    using: str,
    *,
    worker_id: str,
    workflows: Sequence[tuple[str, int]],
    app_ids: Sequence[str] | None,
    limit: int,
    queues: Sequence[str] | None = None,
) -> list[tuple[Any, int]]:
    """Claim up to ``limit`` due runs of workflows this process knows. Returns (id, generation).

    ``workflows`` are (name, version) pairs: a run is claimed only by a process
    holding the code of the version it started with, so in a rolling deploy an
    old worker never runs a new run and a new worker never replays an old one.
    """
    statement = claim_statement(worker_id, workflows, app_ids, limit, queues)
    if statement is None:
        return []
    return db.fetch_statement(using, *statement, setting=CLAIM_PLAN)


def _selection(
    workflows: Sequence[tuple[str, int]],
    app_ids: Sequence[str] | None,
    queues: Sequence[str] | None,
) -> tuple[str, list[Any]]:
    """The conditions on the runs this worker takes, and their parameters: the claim's,
    and the idle probe's "due now" (``idle_probe_ms``), which must agree with it."""
    sql = (
        "\n           AND (workflow_name, workflow_version)"
        " IN (SELECT * FROM unnest(%s::text[], %s::int[]))"
    )
    params: list[Any] = [[name for name, _ in workflows], [version for _, version in workflows]]
    if app_ids:
        sql += " AND app_id = ANY(%s)"
        params.append(list(app_ids))
    if queues:
        # One queue: "=" so that the planner walks the queue's own index in line order.
        sql += " AND queue = %s" if len(queues) == 1 else " AND queue = ANY(%s)"
        params.append(queues[0] if len(queues) == 1 else list(queues))
    return sql, params


def claim_statement(
    worker_id: str,
    workflows: Sequence[tuple[str, int]],
    app_ids: Sequence[str] | None,
    limit: int,
    queues: Sequence[str] | None = None,
) -> tuple[str, list[Any]] | None:
    """The statement of ``claim_runs`` and its parameters; None when there is nothing to
    claim. To be sent after ``CLAIM_PLAN``, in the same transaction.

    ``queues`` (``runworkflows --queue``): only runs enqueued on those django.tasks
    queues; one queue walks ``k2b_run_queued_queue`` (#37)."""
    if limit <= 0 or not workflows:
        return None
    selection, selected = _selection(workflows, app_ids, queues)
    params: list[Any] = [settings.lease_ms(), worker_id, *selected, limit]
    sql = _CLAIM_SQL.format(
        selection=selection,
        claimable=flow.CLAIMABLE,
        not_paused=flow.NOT_PAUSED,
        line=flow.LINE,
    )
    return sql, params


#: A holder known to be alive when its lease expired lost the run because its
#: keeper could not renew in time (a starved host, its own step transaction
#: holding the row past the lease). It is known alive if it is the reaper itself
#: (the first parameter), or if it beat after the lease had expired: a process
#: that died or froze cannot beat after its last renewal plus a lease, and its
#: takeovers always count.
HOLDER_WAS_ALIVE = """(k.claimed_by <> '' AND (k.claimed_by = %s OR EXISTS (
    SELECT 1 FROM k2b_worker w
     WHERE w.worker_id = k.claimed_by
       AND w.state = 'alive' AND w.heartbeat_at > k.lease_expires_at)))"""

LIVE_LOSS = "lease lost by a live worker (not counted as a failure) at step "
LIVE_LOSS_AGAIN = "lease lost by a live worker again, no step done since (counted) at step "

#: The first live loss at a step is free; another at the same step, with no step
#: done since, counts. So a run whose action hangs past its timeout in a live
#: worker every time, or whose lease is too short for its host, still exhausts its
#: retries (one attempt later than a crash loop) instead of passing from worker to
#: worker for ever.
_FREE = (
    f"({HOLDER_WAS_ALIVE} AND k.error_message NOT IN ("
    f"'{LIVE_LOSS}' || COALESCE(k.current_step::text, '-'),"
    f" '{LIVE_LOSS_AGAIN}' || COALESCE(k.current_step::text, '-')))"
)

#: An expired run whose holder may still be running (``holders.py``) is not taken
#: from it when it is inside an external call, or holds a concurrency slot: its
#: lease is extended instead, and it is looked at again when that runs out (#47).
#: Taken over, an external call's answer would land after the takeover had asked
#: ``reconcile()``, which a provider that has not seen the call yet answers
#: "absent"; a keyed run's action would run a second time beside the first,
#: two inside a limit-1 key. Left to its holder, the answer commits as if the
#: lease had never lapsed: the fence checks the generation, not the clock. A
#: holder that reports its calls and is out of this one (its answer lost with a
#: failover) is not waited for (``holders.inside``); a slot waits while it is present.
_HELD = (
    f"(({holders.IN_CALL} AND {holders.inside('k.claimed_by', 'k.id::text')})"
    f" OR (k.holds_slot AND {holders.present('k.claimed_by')}))"
)

_REAP_SQL = (
    "WITH"
    + flow.SWEEP_CTE
    + """,
expired AS MATERIALIZED (
    SELECT k.id, """
    + _FREE
    + " AS free, "
    + HOLDER_WAS_ALIVE
    + " AS alive, "
    + _HELD
    + """ AS held
      FROM k2b_run k
     WHERE k.status = 'running' AND k.lease_expires_at < k2b_now()
       AND NOT (k.claimed_by = %s AND k.id = ANY(%s::uuid[]))
     LIMIT 500 FOR UPDATE OF k SKIP LOCKED),
stood_aside AS (
    UPDATE k2b_run r SET lease_expires_at = k2b_now() + %s * interval '1 millisecond'
      FROM expired e
     WHERE r.id = e.id AND e.held
    RETURNING r.id),
requeued AS (
    UPDATE k2b_run r
       SET """
    + requeue_set(
        release=True,
        consecutive_failures="r.consecutive_failures + CASE WHEN e.free THEN 0 ELSE 1 END",
        run_after="k2b_now() + CASE WHEN e.free THEN 0 ELSE"
        " LEAST(%s * power(2, LEAST(r.consecutive_failures, 30)), %s) END"
        " * interval '1 millisecond'",
        lease_lost_by="COALESCE(r.lease_lost_by, '[]'::jsonb) || to_jsonb(r.claimed_by)",
        error_message=f"CASE WHEN e.free THEN '{LIVE_LOSS}' WHEN e.alive THEN '{LIVE_LOSS_AGAIN}'"
        " ELSE 'lease expired (worker crashed, froze or timed out) at step ' END"
        " || COALESCE(r.current_step::text, '-')",
    )
    + """
      FROM expired e
     WHERE r.id = e.id AND NOT e.held
    RETURNING e.free)
SELECT (SELECT count(*) FROM stood_aside), ARRAY(SELECT free FROM requeued)
"""
)

_PROMOTE_SQL = f"""
UPDATE k2b_run
   SET {requeue_set(release=False, run_after="k2b_now()")}
 WHERE id IN (SELECT id FROM k2b_run
               WHERE status = 'waiting' AND wait_deadline <= k2b_now()
               LIMIT 500 FOR UPDATE SKIP LOCKED)
"""


def reap_expired(using: str, worker_id: str = "", executing: Sequence[Any] = ()) -> int:
    """Re-queue runs whose lease expired: a crash counts as a consecutive failure.

    ``executing``: runs this worker (``worker_id``) executes, in time: their keeper
    is late, and renews them at its next tick; they are not taken from ourselves.
    A takeover from a holder that was still alive (``HOLDER_WAS_ALIVE``) is not
    counted, once per step (``_FREE``): on a starved host a live worker's keeper
    may renew late, and counting that against the run failed orders that had no
    fault of their own (#38). Either way the run is taken over at once, and the
    old holder is fenced; but not a run whose holder may still be inside an
    external call, or that holds a slot (``_HELD``): its lease is extended and it
    stays the holder's until the holder goes on or is gone (#47).

    In the same statement, free the slots of ended runs whose worker died
    inside ``run()`` (``flow.SWEEP_CTE``).

    The run keeps its generation until the next claim raises it, and the
    status change alone already fences the old holder out.
    """
    with connections[using].cursor() as cursor:
        cursor.execute(
            _REAP_SQL,
            [
                worker_id,
                worker_id,
                settings.worker_fresh_ms(),
                settings.worker_fresh_ms(),
                worker_id,
                list(executing),
                settings.lease_ms(),
                settings.retry_backoff_ms(),
                settings.retry_backoff_max_ms(),
            ],
        )
        stood_aside, free = cursor.fetchone()
    reaped = len(free)
    if any(free):
        logger.warning(
            "re-queued %d run(s) whose live worker renewed its lease too late;"
            " not counted as failures",
            sum(free),
        )
    if stood_aside:
        logger.warning(
            "left %d run(s) to their holder, still present inside an external call"
            " past its lease; looked at again in a lease",
            stood_aside,
        )
    # Counted before the caller's commit: a rolled-back reap is re-counted by the next one.
    counters.count_lease_takeovers(reaped)
    return reaped


def promote_due_waits(using: str) -> int:
    """Re-queue waiting runs whose deadline passed. A deadline never fails a step by itself."""
    with connections[using].cursor() as cursor:
        cursor.execute(_PROMOTE_SQL)
        return cursor.rowcount


#: Milliseconds until the next run becomes claimable (or a wait or a lease ends).
#: What comes due without anyone being told: each term the database's time at
#: which something becomes due (now, if it is due already), or NULL.
_DUE_TERMS = (
    f"""(SELECT k2b_now() FROM k2b_run
      WHERE status = 'queued' AND {flow.CLAIMABLE} AND {flow.NOT_PAUSED}
        AND {flow.LINE} <= k2b_now() AND run_after <= k2b_now() LIMIT 1)""",
    f"""(SELECT min({flow.LINE}) FROM k2b_run
      WHERE status = 'queued' AND {flow.CLAIMABLE} AND {flow.NOT_PAUSED}
        AND {flow.LINE} > k2b_now() AND priority_credit_ms = 0)""",
    f"""(SELECT min(run_after) FROM k2b_run
      WHERE status = 'queued' AND priority_credit_ms > 0 AND {flow.CLAIMABLE}
        AND {flow.NOT_PAUSED} AND run_after > k2b_now())""",
    f"(SELECT min(run_after) FROM k2b_run WHERE {flow.DELAYED_KEYED})",
    "(SELECT min(wait_deadline) FROM k2b_run WHERE status = 'waiting')",
    "(SELECT min(lease_expires_at) FROM k2b_run WHERE status = 'running')",
)

#: What only the housekeeping acts on: a run's timeout, the slot of an ended run
#: whose holder stopped renewing it (``flow.SWEEP_CTE``), a batch whose members have
#: all finished (``batches.py``); an AI task queued for a provider, when this
#: process has one.
_HOUSEKEEPING_TERMS = (
    "(SELECT min(timeout_at) FROM k2b_run WHERE timeout_at IS NOT NULL"
    " AND status IN ('queued', 'running', 'waiting'))",
    "(SELECT min(COALESCE(lease_expires_at, k2b_now())) FROM k2b_run"
    " WHERE holds_slot AND status IN ('succeeded', 'failed', 'canceled'))",
    batches.DUE_NOW_TERM,
)
_AI_QUEUED_TERM = (
    "(SELECT k2b_now() FROM k2b_ai_task WHERE status = 'queued' AND provider = ANY(%s) LIMIT 1)"
)
#: A run this worker would claim now: the claim's own conditions (``_CLAIM_SQL``),
#: so that a run only another worker takes (another queue, app or version) does
#: not make every pass a full one.
_OURS_NOW_TERM = f"""(SELECT k2b_now() FROM k2b_run
      WHERE status = 'queued' AND {flow.CLAIMABLE}
        AND {flow.NOT_PAUSED} AND {flow.LINE} <= k2b_now() AND run_after <= k2b_now()
        {{selection}} LIMIT 1)"""


def _due_in_ms_sql(terms: Sequence[str]) -> str:
    return (
        "SELECT EXTRACT(EPOCH FROM (LEAST(\n    "
        + ",\n    ".join(terms)
        + "\n) - k2b_now())) * 1000"
    )


_NEXT_DUE_SQL = _due_in_ms_sql(_DUE_TERMS)


def _due_in_ms(using: str, sql: str, params: Sequence[Any] = ()) -> float | None:
    with connections[using].cursor() as cursor:
        cursor.execute(sql, params)
        value = cursor.fetchone()[0]
    return None if value is None else max(0.0, float(value))


def next_due_in_ms(using: str) -> float | None:
    """Milliseconds until the next delayed run or deadline is due (None: nothing pending).

    Three reads of two indexes, each stopping at its first row: a claimable run
    due now; the next line order still to come of a run of priority 0 (due at
    its line order; the walk skips only delayed runs with a priority); the next
    ``run_after`` of a run with a priority, whose line order comes before it.
    Runs queued behind a key are admitted by a transaction that notifies the
    workers. A paused queue's runs are not counted: its due runs would wake the
    loop at once, for ever; its resume notifies the workers (#49).
    """
    return _due_in_ms(using, _NEXT_DUE_SQL)


def idle_probe_ms(
    using: str,
    *,
    workflows: Sequence[tuple[str, int]],
    app_ids: Sequence[str] | None = None,
    queues: Sequence[str] | None = None,
    providers: Sequence[str] = (),
) -> float | None:
    """``next_due_in_ms`` and what the housekeeping acts on, in one statement (#52).

    An idle worker's pass: 0 when a claim or the housekeeping has something to
    do now, else the milliseconds until it will (None: nothing pending). Every
    term reads one partial index and stops at its first row, so an idle fleet
    costs one read-only statement per worker and poll, no transaction and no
    WAL, where a full pass (claim, AI claim, housekeeping) costs a dozen
    statements and two transactions.

    A run due now counts only if this worker would claim it (``workflows``,
    ``app_ids`` and ``queues`` as ``claim_statement`` takes them): a worker of
    queue ``mail`` beside a due run of queue ``default`` made a full pass every
    5 ms, a hundred a second (#52). Runs still to come count whoever claims
    them: the probe then wakes once, when one comes due. ``providers``: the AI
    providers of this process, whose queued tasks are claimable work too. An AI
    task whose worker died, and stale rendezvous rows, wait for the loop's full
    round.
    """
    terms = list(_DUE_TERMS[1:] + _HOUSEKEEPING_TERMS)
    params: list[Any] = []
    if workflows:
        selection, params = _selection(workflows, app_ids, queues)
        terms.insert(0, _OURS_NOW_TERM.format(selection=selection))
    if providers:
        terms.append(_AI_QUEUED_TERM)
        params.append(list(providers))
    return _due_in_ms(using, _due_in_ms_sql(terms), params)


_RENEW_SQL = """
UPDATE k2b_run r
   SET lease_expires_at = k2b_now() + %s * interval '1 millisecond'
  FROM (SELECT k.id FROM k2b_run k
          JOIN unnest(%s::uuid[], %s::bigint[]) AS a(id, gen)
            ON k.id = a.id AND k.generation = a.gen AND k.status = 'running'
           FOR NO KEY UPDATE OF k SKIP LOCKED) s
 WHERE r.id = s.id
RETURNING r.id, r.cancel_requested_at IS NOT NULL
"""


#: The status and generation of held runs the renewal skipped: lost, ended or canceled?
_STATES_SQL = "SELECT id, status, generation FROM k2b_run WHERE id = ANY(%s)"


def renew_leases(conn: Any, held: dict[Any, int], lease: int) -> tuple[set, dict[Any, tuple], set]:
    """Renew the leases of ``held`` (run id -> generation) on a raw autocommit connection.

    Rows locked by our own step transactions are skipped, not waited for
    (the step's commit extends the lease itself). Returns the renewed ids,
    for the others their current (status, generation) when visible, and the
    renewed runs whose call was asked to stop (``tasks.cancel``, #49).
    """
    if not held:
        return set(), {}, set()
    ids = list(held)
    rows = conn.execute(_RENEW_SQL, [lease, ids, [held[i] for i in ids]]).fetchall()
    renewed = {row[0] for row in rows}
    asked = {row[0] for row in rows if row[1]}
    others = [i for i in ids if i not in renewed]
    states: dict[Any, tuple] = {}
    if others:
        for run_id, status, generation in conn.execute(_STATES_SQL, [others]).fetchall():
            states[run_id] = (status, generation)
    return renewed, states, asked


_RELEASE_SQL = f"""
UPDATE k2b_run
   SET {requeue_set(release=True, run_after="k2b_now()")}
 WHERE id = %s AND generation = %s AND status = 'running'
"""

_RELEASE_AFTER_SQL = f"""
UPDATE k2b_run
   SET {requeue_set(release=True, run_after=AFTER_MS)}
 WHERE id = %s AND generation = %s AND status = 'running'
"""


def release(using: str, run_id: uuid.UUID, generation: int, after_ms: int = 0) -> bool:
    """Hand a run we still own back to the queue, without counting a failure.

    ``after_ms``: claimable only after this delay (its holder may still be inside
    an external call: ``effects.External.wait_for_holder``)."""
    with connections[using].cursor() as cursor:
        if after_ms:
            cursor.execute(_RELEASE_AFTER_SQL, [after_ms, run_id, generation])
        else:
            cursor.execute(_RELEASE_SQL, [run_id, generation])
        return cursor.rowcount == 1


#: Each run handed back may be claimed after its own delay (a lease, for one whose
#: EXTERNAL step may still land: ``hand_back``).
_HAND_BACK_AFTER = "k2b_now() + free.delay_ms * interval '1 millisecond'"

_HAND_BACK_SQL = f"""
WITH held(id, gen, delay_ms) AS (SELECT * FROM unnest(%s::uuid[], %s::bigint[], %s::bigint[])),
     free AS (SELECT k.id, held.delay_ms
                FROM k2b_run k JOIN held ON k.id = held.id AND k.generation = held.gen
               WHERE k.status = 'running'
                 FOR NO KEY UPDATE OF k SKIP LOCKED)
UPDATE k2b_run r
   SET {requeue_set(release=True, run_after=_HAND_BACK_AFTER)}
  FROM free
 WHERE r.id = free.id
RETURNING r.id
"""


def hand_back(using: str, held: dict[Any, tuple[int, int]]) -> set[Any]:
    """Queue runs we still own again at once, without counting a failure (a shutdown).

    ``held``: run id -> (generation, delay in ms before another worker may claim it).
    A run whose row is locked by one of our step transactions is skipped, not
    waited for: that transaction may still commit, and the fence makes it
    fail once the run is queued. Returns the ids handed back.
    """
    if not held:
        return set()
    ids = list(held)
    with connections[using].cursor() as cursor:
        cursor.execute(_HAND_BACK_SQL, [ids, [held[i][0] for i in ids], [held[i][1] for i in ids]])
        return {row[0] for row in cursor.fetchall()}


_ORPHANS_SQL = f"""
UPDATE k2b_run
   SET {requeue_set(release=True, run_after="k2b_now()")}
 WHERE id IN (SELECT id FROM k2b_run
               WHERE status = 'running' AND claimed_by = %s AND NOT (id = ANY(%s::uuid[]))
                 FOR NO KEY UPDATE SKIP LOCKED)
"""


def hand_back_orphans(using: str, worker_id: str, executing: list[Any]) -> int:
    """Queue again runs claimed under ``worker_id`` that none of its threads executes.

    A claim whose COMMIT lost its answer (the connection died during it) may
    have committed: its runs are ours in the database and nobody's in memory.
    Left alone they wait for their lease to expire and count a failure; handed
    back they run now. Nothing of ours can commit for them, so this is safe.
    """
    with connections[using].cursor() as cursor:
        cursor.execute(_ORPHANS_SQL, [worker_id, list(executing)])
        return cursor.rowcount
