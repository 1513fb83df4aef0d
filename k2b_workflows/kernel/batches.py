"""A batch's callbacks, enqueued once when its last member has finished (#50).

The failure this module is built around: a batch whose callbacks run early,
twice or never. Counter designs (a row per batch that every member's end
decrements) fail the third way: a crash between a member's end and its
decrement leaves the count above zero for ever. And their row is one that
every member's end of the batch waits on.

Here a member's end writes nothing for its batch. A worker's housekeeping
(``due``) asks the runs which open batches have no member left that has not
finished, an index walk over the batch's members (``k2b_run_batch``), and
``fire`` then, in one transaction: locks the batch row, asks again (the
answer it acts on is read under the lock, after every end committed before
it), enqueues the callbacks and marks the row finished. A crash before the
commit leaves the batch open and unfired for the next pass of any worker;
after it, both are done. Each callback's run carries an idempotency key made
of the batch and the callback's name, so that even a pass that found the row
unmarked (two detectors, a mark cleared by hand) inserts no second run: the
database's unique constraint on the key, not a read, is the guard.

A member that needs an operator has not finished: its batch waits until it is
resolved, retried or canceled.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from psycopg.types.json import Jsonb

from ..models import TaskBatch
from ..workflows import get_workflow
from . import clock, db, hashing, seals, starts

logger = logging.getLogger(__name__)

#: The callbacks, in the order they are enqueued: ``on_finish`` whatever the members'
#: ends, then ``on_success`` if every member succeeded, ``on_failure`` if not.
CALLBACKS = ("on_finish", "on_success", "on_failure")

#: The outcome of a batch whose row failed its seal: its callbacks were not enqueued.
REFUSED = "refused"
#: A member's statuses until it has finished (``needs_attention`` included).
_UNFINISHED = ("queued", "running", "waiting", "needs_attention")
#: The ends of a member that did not succeed (a canceled call is a failed call).
_NOT_SUCCEEDED = ("failed", "canceled")
#: A batch's members: the expression and predicate of the index ``k2b_run_batch``
#: (retention asks it too: a batch row goes once its members have).
MEMBER_OF = "input ? 'batch' AND (input ->> 'batch') = {batch}"


def _any_member_in(batch: str, statuses: tuple[str, ...]) -> str:
    """Whether a member of ``batch`` is in one of ``statuses``: one equality probe of
    ``k2b_run_batch`` per status. Not ``status IN (...)``: the planner may walk every
    member of the batch and filter on the status, and a batch has ten thousand."""
    member = MEMBER_OF.format(batch=batch)
    return " OR ".join(
        f"EXISTS (SELECT 1 FROM k2b_run WHERE {member} AND status = '{status}')"
        for status in statuses
    )


#: Open batches without a member that has not finished, oldest first.
DUE_SQL = f"""
SELECT b.id FROM k2b_task_batch b
 WHERE b.finished_at IS NULL
   AND NOT ({_any_member_in("b.id::text", _UNFINISHED)})
 ORDER BY b.created_at
 LIMIT %s
"""
#: For a worker's idle probe (``claim.idle_probe_ms``): now, if a batch is due. A pass
#: that finds nothing is followed by probes, not passes (#52): without this, the batch
#: whose last member ended just after a pass waited for the loop's next full round.
DUE_NOW_TERM = f"""(SELECT k2b_now() FROM k2b_task_batch b
      WHERE b.finished_at IS NULL
        AND NOT ({_any_member_in("b.id::text", _UNFINISHED)}) LIMIT 1)"""
#: The batch row, if still open and not locked by another pass firing it.
LOCK_SQL = """
SELECT task_path, total, callbacks, seal FROM k2b_task_batch
 WHERE id = %s AND finished_at IS NULL
   FOR UPDATE SKIP LOCKED
"""
#: Whether a member of the batch (its id, once per status) has not finished.
UNFINISHED_SQL = f"SELECT {_any_member_in('%s', _UNFINISHED)}"
#: Whether a member of the batch (its id, once per status) failed or was canceled.
NOT_SUCCEEDED_SQL = f"SELECT {_any_member_in('%s', _NOT_SUCCEEDED)}"
FINISH_SQL = """
UPDATE k2b_task_batch SET finished_at = k2b_now(), outcome = %s, callback_runs = %s WHERE id = %s
"""
COUNTS_SQL = f"""
SELECT status, count(*) FROM k2b_run WHERE {MEMBER_OF.format(batch="%s")} GROUP BY status
"""


@dataclass(frozen=True, slots=True)
class Counts:
    """A batch's members by status, and when its callbacks were enqueued."""

    total: int
    by_status: dict[str, int]
    finished_at: Any
    outcome: str
    callback_runs: dict[str, str]


def callback_key(batch_id: uuid.UUID | str, name: str) -> str:
    """The idempotency key of the run of callback ``name`` of the batch: one per pair."""
    return f"k2b.batch:{batch_id}:{name}"


def _seal_text(batch_id: Any, task_path: str, total: int, callbacks: Any) -> str:
    return hashing.canonical(["batch", str(batch_id), task_path, int(total), callbacks])


def create(
    using: str, batch_id: uuid.UUID, task_path: str, total: int, callbacks: dict[str, Any]
) -> TaskBatch:
    """Insert the batch row, sealed, in the caller's transaction (its members' too).

    ``callbacks``: name -> {"workflow": its task workflow, "input": its run's input},
    built and checked by the caller.
    """
    unknown = set(callbacks) - set(CALLBACKS)
    if unknown:
        raise ValueError(f"unknown callbacks {sorted(unknown)}")
    batch = TaskBatch(
        id=batch_id,
        task_path=task_path,
        total=total,
        callbacks=callbacks,
        seal=seals.seal_of(_seal_text(batch_id, task_path, total, callbacks)),
        created_at=clock.now(),
    )
    batch.save(using=using, force_insert=True)
    return batch


def due(using: str, limit: int = 100) -> list[uuid.UUID]:
    """Open batches whose members have all finished, as committed now (one index walk each)."""
    return [row[0] for row in db.fetchall(using, DUE_SQL, [limit])]


def fire(using: str, batch_id: uuid.UUID) -> bool:
    """Enqueue the callbacks of ``batch_id`` and mark it finished, if every member has
    finished; in one transaction of its own. False: not due, or another pass has it."""
    with transaction.atomic(using=using):
        rows = db.fetchall(using, LOCK_SQL, [batch_id])
        if not rows:
            return False
        task_path, total, callbacks, sealed = rows[0]
        if isinstance(callbacks, str):  # Django reads jsonb as its text on its connections
            callbacks = json.loads(callbacks)
        # Asked again under the lock: the walk that found it ran before, and a member
        # re-queued since (an operator's retry) has not finished.
        if db.fetchall(using, UNFINISHED_SQL, [str(batch_id)] * len(_UNFINISHED))[0][0]:
            return False
        problem = seals.text_problem(sealed, _seal_text(batch_id, task_path, total, callbacks))
        if problem is not None:
            # Marked, so that it is refused once and does not stand in the way of the
            # batches behind it: shown as "refused" in the admin, its callbacks not run.
            logger.error("batch %s: its callbacks are not used: the row %s", batch_id, problem)
            db.execute(using, FINISH_SQL, [REFUSED, Jsonb({}), batch_id])
            return False
        failed = db.fetchall(using, NOT_SUCCEEDED_SQL, [str(batch_id)] * len(_NOT_SUCCEEDED))[0][0]
        chosen = ("on_finish", "on_failure" if failed else "on_success")
        runs: dict[str, str] = {}
        for name in chosen:
            spec = callbacks.get(name)
            if spec is None:
                continue
            run = starts.start(
                using,
                get_workflow(spec["workflow"]),
                spec["input"],
                idempotency_key=callback_key(batch_id, name),
            )
            runs[name] = str(run.pk)
        outcome = "failed" if failed else "successful"
        db.execute(using, FINISH_SQL, [outcome, Jsonb(runs), batch_id])
    logger.info("batch %s finished (%s): enqueued %s", batch_id, outcome, sorted(runs) or "none")
    return True


def fire_due(using: str, batch_ids: list[uuid.UUID]) -> int:
    """``fire`` each of ``batch_ids`` (``due``'s answer); returns how many fired.

    A batch whose callbacks cannot be enqueued now (a callback's workflow not
    registered in this process, the database's refusal) is logged and left for
    the next pass, its own transaction rolled back: the batches after it fire.
    """
    fired = 0
    for batch_id in batch_ids:
        try:
            fired += fire(using, batch_id)
        except Exception:
            logger.exception("batch %s: its callbacks were not enqueued; next pass", batch_id)
    return fired


def counts(using: str, batch_id: uuid.UUID) -> Counts | None:
    """The batch's members by status (one index walk), or None: no such batch."""
    batch = TaskBatch.objects.using(using).filter(pk=batch_id).first()
    if batch is None:
        return None
    by_status = dict(db.fetchall(using, COUNTS_SQL, [str(batch_id)]))
    return Counts(
        total=batch.total,
        by_status={str(k): int(v) for k, v in by_status.items()},
        finished_at=batch.finished_at,
        outcome=batch.outcome,
        callback_runs=dict(batch.callback_runs or {}),
    )
