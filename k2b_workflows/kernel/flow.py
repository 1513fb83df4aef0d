"""Flow control: concurrency slots per key, priorities with aging, rate-limited dispatches.

The failures this module is built around, each seen in a peer's queue:

- **A leaked slot.** A slot held by a worker (or by an assignment record)
  outlives the worker that crashed holding it, and the key's queue freezes
  for good. Here a slot is a column of the run (``holds_slot``) and nothing
  else: a takeover after SIGKILL re-queues the same run with its slot, and a
  trigger on the row clears it in the very statement that ends the run
  (success, failure, cancel, an operator's resolution, a hand-written
  ``UPDATE``), then admits the key's next run in the same transaction. No
  path has to remember to free it.
- **Over-admission from a snapshot count.** Counting a key's active runs in
  the snapshot of the claim (with ``SKIP LOCKED``) lets two claimers each see
  one free slot and both take it. Here every admission counts the key's
  holders under ``pg_advisory_xact_lock`` on the key, in a statement that
  starts after the lock is granted (``k2b_flow_holders``), so it sees what the
  previous holder of the lock committed. The claim itself never counts: a
  keyed run without a slot is not in the claim's index at all.
- **A rate limit per process.** A limit kept in a worker's memory is
  multiplied by the number of workers. Here each dispatch of a rate-limited
  action first commits a reservation in ``k2b_rate_dispatch`` under the key's
  advisory lock, stamped with PostgreSQL's clock just before ``run()`` (until
  then it counts as a call made now), and a full window defers the run to
  the instant the window frees: re-queued, no thread held, no failure
  counted, nothing charged (the budget is charged after admission, once per
  step as always).
- **Starvation of low priorities.** A strict priority order lets a steady
  flood of important runs starve the rest. Here a run stands in line at
  ``run_after - priority x PRIORITY_AGING_MS``: waiting that long counts as one
  level, so a run of priority 0 waits at most ``p x PRIORITY_AGING_MS`` behind
  runs of priority ``p`` started after it.

The claim stays one index walk: ``k2b_run_queued`` holds the claimable queued
runs (no key, or a slot) in line order, so runs that use none of this are
claimed exactly as before, and a backlog behind busy keys is never read.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from typing import TYPE_CHECKING, Any

from django.db import connections, transaction

from .. import counters, settings, validation
from ..exceptions import InvalidInput
from ..triggers import PRESENCE_LOCK
from .requeue import requeue_set

if TYPE_CHECKING:
    from ..actions import Action
    from ..limits import Concurrency, RateLimit
    from ..workflows import WorkflowDefinition

logger = logging.getLogger(__name__)

#: Highest ``priority`` (0 is the lowest and the default).
MAX_PRIORITY = 1_000

#: Where a queued run stands among the runs of its concurrency key, which admission
#: takes in this order (``k2b_run_behind_key``, ``k2b_flow_admit``).
QUEUE_ORDER = "k2b_queue_order(run_after, priority_credit_ms)"

#: Where a queued run stands in the claim's line; the claim's index is on this
#: expression (``models.LINE``). ``QUEUE_ORDER``, except for a run that takes turns
#: with other keys (``fairness_key``): its place among their turns
#: (``k2b_fair_line``, migration 0036) stands in for its ``run_after``.
LINE = "k2b_queue_order(COALESCE(fair_line, run_after), priority_credit_ms)"

#: Claimable: not keyed, or holding a slot. The same text as the index's condition.
CLAIMABLE = "(concurrency_key IS NULL OR holds_slot)"

#: Not in a paused queue (``kernel/pauses.py``, #49): added by every statement that
#: claims or looks for claimable runs. The subquery has no outer reference, so it is
#: read once per statement and hashed; its column is a primary key, never NULL, so
#: ``NOT IN`` holds back no run by a NULL.
NOT_PAUSED = "queue NOT IN (SELECT queue FROM k2b_queue_pause)"

#: A queued keyed run not due yet, so without a slot (#35): pending work that the
#: housekeeping admits once due (``admit_due``). Read through ``k2b_run_delayed_keyed``.
DELAYED_KEYED = (
    "(concurrency_key IS NOT NULL AND NOT holds_slot AND status = 'queued'"
    " AND run_after > k2b_now())"
)

#: A queued keyed run without a slot that the housekeeping's next ``admit_due`` will
#: consider: not due yet, or due after its last pass (whose ``now`` is the one
#: parameter; NULL: no pass yet, so only those not due). A run due before that
#: pass and still without a slot waits for a slot another run holds.
UNADMITTED_KEYED = (
    "(concurrency_key IS NOT NULL AND NOT holds_slot AND status = 'queued'"
    " AND run_after > COALESCE(%s::timestamptz, k2b_now()))"
)

_HOLDERS_SQL = """
SELECT id, status FROM k2b_run
 WHERE workflow_name = %s AND concurrency_key = %s AND holds_slot
 ORDER BY created_at, id
   FOR UPDATE
"""

#: The holders ``cancel_in_progress`` may cancel: not one that needs an operator,
#: nor one that ended and whose action has not left ``run()`` yet.
_CANCELABLE_HOLDERS = frozenset({"queued", "running", "waiting"})

_DEFER_SQL = f"""
UPDATE k2b_run
   SET {requeue_set(release=True, run_after="%s", deferred_by="%s")}
 WHERE id = %s AND generation = %s AND status = 'running'
"""


# -- starting a run ------------------------------------------------------------


def start_fields(
    definition: WorkflowDefinition,
    *,
    concurrency_key: Any,
    priority: Any,
    run_after: Any,
    now: dt.datetime,
    concurrency: Concurrency | None = None,
) -> dict[str, Any]:
    """The flow-control columns of a new run, or ``InvalidInput`` naming the argument.

    ``concurrency``: the run's own limit where it is not its workflow's (a
    django.tasks task declares one per task, and its runs share three workflows).
    """
    fields: dict[str, Any] = {"run_after": now}
    declared = concurrency if concurrency is not None else definition.concurrency
    if concurrency_key is not None:
        validation.text(concurrency_key, "concurrency_key", max_length=255)
        if declared is None:
            raise InvalidInput(
                f"concurrency_key given, but workflow {definition.name!r} declares no "
                "concurrency=Concurrency(...): the key would limit nothing"
            )
        fields["concurrency_key"] = concurrency_key
        fields["concurrency_limit"] = declared.limit
    validation.integer(priority, "priority", minimum=0, maximum=MAX_PRIORITY)
    fields["priority"] = priority
    fields["priority_credit_ms"] = priority * settings.priority_aging_ms()
    if run_after is not None:
        if not isinstance(run_after, dt.datetime):
            raise InvalidInput(
                f"run_after must be a timezone-aware datetime, not {type(run_after).__name__}"
            )
        if run_after.tzinfo is None or run_after.utcoffset() is None:
            raise InvalidInput(
                "run_after must be timezone-aware (a naive datetime is ambiguous): "
                "use django.utils.timezone.now() + timedelta(...)"
            )
        fields["run_after"] = max(run_after, now)
    return fields


#: How many runs hold a slot of the key.
_HOLDER_COUNT_SQL = "SELECT k2b_flow_holders(%s, %s)"


def has_room(using: str, definition: WorkflowDefinition, key: str, limit: int) -> bool:
    """``cancel_newest``: whether the key has a free slot, counted under its lock.

    The lock is held until the start commits, so a concurrent start counts
    after this one's run is in. Must run inside the start's transaction.
    ``limit``: the key's (its workflow's, or a task's own).
    """
    with connections[using].cursor() as cursor:
        cursor.execute(_HOLDER_COUNT_SQL, [definition.name, key])
        return bool(cursor.fetchone()[0] < limit)


def holders_to_cancel(
    using: str, definition: WorkflowDefinition, key: str, limit: int
) -> list[Any]:
    """``cancel_in_progress``: the oldest holders of the key to cancel to make room for one.

    Locks the holders' rows first and the key later (the cancel's trigger
    takes it): the order in which a holder's own end takes them, so the two
    never deadlock. Must run inside the start's transaction.

    Never a holder that needs an operator (#35): its effect is unknown, and
    canceling it took the incident out of the operators' queue while the new
    run charged again. Such a holder keeps its slot; the new run waits behind
    the key until the incident is resolved. Nor one already canceled whose
    action is still inside ``run()``: it keeps its slot until it has left.
    """
    with connections[using].cursor() as cursor:
        cursor.execute(_HOLDERS_SQL, [definition.name, key])
        holders = cursor.fetchall()
    cancelable = [run_id for run_id, status in holders if status in _CANCELABLE_HOLDERS]
    return cancelable[: max(0, len(holders) - limit + 1)]


# -- a delayed run takes its slot once due -------------------------------------------

#: Keyed runs that became due since ``%s`` (the database's time of the previous
#: pass; NULL: ever) without a slot: their keys' admissions, once per key. A run
#: started with a ``run_after`` holds no slot before it is due (#35): one in year
#: 9999 held the key's only slot. Read through ``k2b_run_delayed_keyed``: only
#: the runs that became due since the last pass, never the backlog behind a key.
_ADMIT_DUE_SQL = """
SELECT k2b_now(), COALESCE(sum(k2b_flow_admit(k.workflow_name, k.concurrency_key)), 0)
  FROM (SELECT DISTINCT workflow_name, concurrency_key FROM k2b_run
         WHERE status = 'queued' AND NOT holds_slot AND concurrency_key IS NOT NULL
           AND run_after <= k2b_now()
           AND run_after > COALESCE(%s::timestamptz, '-infinity')) k
"""


def admit_due(using: str, since: dt.datetime | None) -> tuple[dt.datetime, int]:
    """Admit the keyed runs that became due after ``since``; returns (now, runs admitted).

    The worker's housekeeping calls it with the ``now`` of its previous call.
    A run due at its start was admitted by its insert's trigger already.
    """
    with connections[using].cursor() as cursor:
        cursor.execute(_ADMIT_DUE_SQL, [since])
        now, admitted = cursor.fetchone()
    return now, int(admitted)


# -- a slot held until the action has left run() ----------------------------------

#: A run that ended under its worker (a cancel, a timeout) keeps its slot while its
#: lease is live (``triggers.SlotRelease``): its worker's keeper renews that lease
#: while the action is inside ``run()``, and clears it once the action has left.
_HOLD_SQL = """
UPDATE k2b_run r
   SET lease_expires_at = k2b_now() + %s * interval '1 millisecond'
  FROM unnest(%s::uuid[], %s::bigint[]) AS a(id, gen)
 WHERE r.id = a.id AND r.generation = a.gen AND r.holds_slot
   AND r.status IN ('succeeded', 'failed', 'canceled') AND r.lease_expires_at > k2b_now()
"""

_LEAVE_SQL = """
UPDATE k2b_run SET lease_expires_at = NULL
 WHERE id = %s AND generation = %s AND holds_slot
   AND status IN ('succeeded', 'failed', 'canceled')
"""

#: An ended run's holder is gone, or is this very session (``triggers.SlotRelease``):
#: its presence lock can be taken. A present holder keeps its slot, whatever its
#: lease says, until it has left ``run()`` (#47).
HOLDER_GONE = (
    f"(claimed_by = '' OR pg_catalog.pg_try_advisory_xact_lock("
    f"{PRESENCE_LOCK.format(worker='claimed_by')}))"
)

#: The housekeeping's half: slots of ended runs whose lease ran out (their worker
#: died inside ``run()``) or that hold one with no lease at all, once the holder is
#: gone. Rides on the reap's statement (``claim.reap_expired``): no round trip of its own.
SWEEP_CTE = f"""
freed AS (
    UPDATE k2b_run SET lease_expires_at = NULL
     WHERE holds_slot AND status IN ('succeeded', 'failed', 'canceled')
       AND (lease_expires_at IS NULL OR lease_expires_at <= k2b_now())
       AND {HOLDER_GONE}
    RETURNING id)
"""


def hold_slots(conn: Any, held: dict[Any, int], lease: int) -> None:
    """Renew the leases of runs that ended while their action is still inside ``run()``.

    ``held``: run id -> generation, on the lease keeper's raw connection. Only
    runs that ended under a worker are ever given (rare: after a cancel or a
    timeout), so a keeper with none sends nothing.
    """
    if held:
        ids = list(held)
        conn.execute(_HOLD_SQL, [lease, ids, [held[i] for i in ids]])


def leave(using: str, run_id: uuid.UUID, generation: int) -> None:
    """Our action has left ``run()`` of a run that ended under us: free its slot, if held.

    The slot's trigger frees it as the lease is cleared, and admits the key's next run.
    A worker's holder says so on its keeper's connection (``LeaseKeeper.leave``): on
    another, its presence lock keeps the slot (``triggers.SlotRelease``).
    """
    with connections[using].cursor() as cursor:
        cursor.execute(_LEAVE_SQL, [run_id, generation])


def leave_on(conn: Any, run_id: uuid.UUID, generation: int) -> None:
    """``leave`` on a raw autocommit connection (the lease keeper's)."""
    conn.execute(_LEAVE_SQL, [run_id, generation])


# -- rate limits ---------------------------------------------------------------


def limit_key(action: Action, input: Any) -> str:
    """The key a step's dispatch counts under: the action's name, and its ``rate_limit_key``."""
    name = action.action_name()
    if not action.defines("rate_limit_key"):
        return name
    key = action.rate_limit_key(input)
    if not isinstance(key, str):
        raise InvalidInput(
            f"{type(action).__name__}.rate_limit_key() must return a str, "
            f"not {type(key).__name__} {key!r:.100}"
        )
    validation.text(key, f"{type(action).__name__}.rate_limit_key()", max_length=400)
    return f"{name}:{key}"


_RATE_ADMIT_SQL = "SELECT dispatch_id, free_at FROM k2b_rate_admit(%s, %s, %s, %s, %s, %s)"


def admit_dispatch(
    using: str, key: str, limit: RateLimit, run_id: uuid.UUID, seq: int, generation: int
) -> tuple[int | None, dt.datetime | None]:
    """Reserve one dispatch under ``key`` in the current transaction.

    Returns (the reservation's id, None), or (None, the instant the window
    frees) when it is full and nothing was reserved. Each dispatch occupies
    ``per`` plus ``RATE_LIMIT_MARGIN_MS`` (what may still pass between the stamp
    and the provider seeing the call).
    """
    per_ms = limit.per_ms + settings.rate_limit_margin_ms()
    with connections[using].cursor() as cursor:
        cursor.execute(
            _RATE_ADMIT_SQL,
            [key, limit.limit, per_ms, run_id, seq, generation],
        )
        dispatch_id, free_at = cursor.fetchone()
    return dispatch_id, free_at


_RATE_STAMP_SQL = "SELECT k2b_rate_stamp(%s)"

#: The stamp's own transaction does not wait for the disk: a stamp lost in a crash
#: leaves the dispatch counted as a call made now, the cautious side.
_ASYNC_COMMIT_SQL = "SET LOCAL synchronous_commit = off"


def stamp_dispatch(using: str, dispatch_id: int) -> None:
    """Time a reserved dispatch on the database's clock, just before ``run()`` is called.

    The reservation committed a commit or two earlier (an IDEMPOTENT step's
    charge, an EXTERNAL step's dispatch entry), a delay that varies from call
    to call; until it is stamped it counts as a call made "now" at every
    admission of its key. Outside a transaction the stamp commits without
    waiting for the disk (``synchronous_commit = off``): one short round trip
    more, not a flush. Inside one (a TRANSACTIONAL step's block) it commits
    with the block.
    """
    conn = connections[using]
    if conn.in_atomic_block:
        with conn.cursor() as cursor:
            cursor.execute(_RATE_STAMP_SQL, [dispatch_id])
        return
    with transaction.atomic(using=using), conn.cursor() as cursor:
        cursor.execute(_ASYNC_COMMIT_SQL)
        cursor.execute(_RATE_STAMP_SQL, [dispatch_id])


def defer(
    using: str, run_id: uuid.UUID, generation: int, until: dt.datetime, key: str, action: str
) -> bool:
    """Queue our run again for ``until`` (a full rate limit): no failure, slot and priority kept.

    ``action``: the step's action name, the metric's label. Not read off ``key``: a
    task's action is named ``task:<path>``, so the text before the key's first
    colon was "task" for every task (#51).
    """
    with connections[using].cursor() as cursor:
        cursor.execute(_DEFER_SQL, [until, key, run_id, generation])
        deferred = cursor.rowcount == 1
    if deferred:
        counters.count_rate_deferral(action)
    return deferred


# -- what operators see --------------------------------------------------------


_LINE_OF_RUN_SQL = f"""
SELECT k2b_now(), {QUEUE_ORDER}, run_after > k2b_now()
FROM k2b_run WHERE id = %s
"""

_KEY_HOLDERS_SQL = """
SELECT id, status FROM k2b_run
WHERE workflow_name = %s AND concurrency_key = %s AND holds_slot
ORDER BY created_at LIMIT 50
"""

_AHEAD_IN_LINE_SQL = f"""
SELECT count(*) FROM k2b_run
WHERE workflow_name = %s AND concurrency_key = %s AND status = 'queued'
  AND NOT holds_slot AND {QUEUE_ORDER} < %s
"""

_RATE_WINDOW_SQL = """SELECT count(*), max(at) FROM k2b_rate_dispatch WHERE limit_key = %s"""


def why_queued(using: str, run: Any) -> dict[str, Any] | None:
    """Why a queued run is not running yet: its key's holders, its line, rate limits.

    None for a run that is not queued.
    """
    if run.status != "queued":
        return None
    with connections[using].cursor() as cursor:
        cursor.execute(
            _LINE_OF_RUN_SQL,
            [run.pk],
        )
        now, line, delayed = cursor.fetchone()
        reason: dict[str, Any] = {
            "priority": run.priority,
            "line_at": line,
            "delayed_until": run.run_after if delayed else None,
            "behind_key": None,
            "rate_limited": None,
        }
        if run.concurrency_key is not None:
            cursor.execute(
                _KEY_HOLDERS_SQL,
                [run.workflow_name, run.concurrency_key],
            )
            holders = [{"id": r[0], "status": r[1]} for r in cursor.fetchall()]
            cursor.execute(
                _AHEAD_IN_LINE_SQL,
                [run.workflow_name, run.concurrency_key, line],
            )
            ahead = cursor.fetchone()[0]
            reason["behind_key"] = {
                "key": run.concurrency_key,
                "limit": run.concurrency_limit,
                "holds_slot": run.holds_slot,
                "holders": holders,
                "ahead": ahead,
            }
        if delayed and run.deferred_by:
            cursor.execute(
                _RATE_WINDOW_SQL,
                [run.deferred_by],
            )
            recent, last = cursor.fetchone()
            reason["rate_limited"] = {
                "key": run.deferred_by,
                "free_at": run.run_after,
                "recent_dispatches": recent,
                "last_dispatch": last,
            }
    reason["now"] = now
    return reason


_ACTIVE_OF_KEY_SQL = """
SELECT id, status, priority, created_at, updated_at FROM k2b_run
WHERE workflow_name = %s AND concurrency_key = %s AND holds_slot
ORDER BY created_at
"""

_QUEUED_OF_KEY_SQL = f"""
SELECT id, status, priority, created_at, run_after FROM k2b_run
WHERE workflow_name = %s AND concurrency_key = %s AND status = 'queued'
  AND NOT holds_slot
ORDER BY {QUEUE_ORDER}, created_at LIMIT %s
"""

_QUEUED_COUNT_OF_KEY_SQL = """
SELECT count(*) FROM k2b_run WHERE workflow_name = %s AND concurrency_key = %s
AND status = 'queued' AND NOT holds_slot
"""


def key_runs(using: str, workflow_name: str, key: str, limit: int = 200) -> dict[str, Any]:
    """A key's active runs (slot holders) and the runs queued behind it, in line order."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            _ACTIVE_OF_KEY_SQL,
            [workflow_name, key],
        )
        active = cursor.fetchall()
        cursor.execute(
            _QUEUED_OF_KEY_SQL,
            [workflow_name, key, limit],
        )
        queued = cursor.fetchall()
        cursor.execute(
            _QUEUED_COUNT_OF_KEY_SQL,
            [workflow_name, key],
        )
        behind = cursor.fetchone()[0]
    columns = ("id", "status", "priority", "created_at")
    return {
        "workflow_name": workflow_name,
        "key": key,
        "active": [dict(zip(columns, r[:4], strict=True)) for r in active],
        "queued": [dict(zip((*columns, "run_after"), r, strict=True)) for r in queued],
        "queued_count": behind,
    }


_BUSIEST_KEYS_SQL = """
SELECT workflow_name, concurrency_key,
      count(*) FILTER (WHERE NOT holds_slot AND status = 'queued'),
      count(*) FILTER (WHERE holds_slot)
 FROM k2b_run
WHERE concurrency_key IS NOT NULL
  AND (holds_slot OR status = 'queued')
GROUP BY 1, 2
ORDER BY 3 DESC, 4 DESC, 1, 2
LIMIT %s
"""


def busiest_keys(cursor: Any, limit: int = 10) -> list[dict[str, Any]]:
    """The keys with the most runs queued behind them, with their holders' count."""
    cursor.execute(
        _BUSIEST_KEYS_SQL,
        [limit],
    )
    return [
        {"workflow_name": r[0], "key": r[1], "queued": int(r[2]), "active": int(r[3])}
        for r in cursor.fetchall()
    ]


_FLOW_COUNTS_SQL = """
SELECT count(*), count(DISTINCT (workflow_name, concurrency_key)) FROM k2b_run
WHERE status = 'queued' AND NOT holds_slot AND concurrency_key IS NOT NULL
"""


def flow_counts(cursor: Any) -> tuple[int, int]:
    """(runs queued behind a key, keys with such runs): the metrics scrape's gauges."""
    cursor.execute(_FLOW_COUNTS_SQL)
    behind, keys = cursor.fetchone()
    return int(behind), int(keys)
