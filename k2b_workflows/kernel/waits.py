"""Parking a run on a dependency and waking it, without ever losing a wake.

Both sides lock the same rendezvous row for ``(app_id, kind, key)`` with an
upsert, so a park and a wake serialize. "Insert my row, then look for the
other side's" loses most wakes under READ COMMITTED; this does not.

The rendezvous counts wakes in ``signal_seq``. A parking run compares it with
the last signal it has seen on that key: a wake that committed before the
park (even before the run ever parked) sends the run straight back to the
queue instead of to sleep. A woken run whose action is still not ready just
parks again; wakes are idempotent.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid

from django.db import connections, transaction
from django.utils import timezone

from .. import settings
from ..actions import Dependency
from ..settings import CHANNEL
from . import attempts, clock
from .requeue import NOW, requeue_set

_UPSERT_SQL = """
INSERT INTO k2b_wait (app_id, kind, key, signal_seq, signaled_at, created_at)
VALUES (%s, %s, %s, %s, CASE WHEN %s THEN k2b_now() END, k2b_now())
ON CONFLICT (app_id, kind, key) DO UPDATE
   SET signal_seq = k2b_wait.signal_seq + %s,
       signaled_at = CASE WHEN %s THEN k2b_now() ELSE k2b_wait.signaled_at END
RETURNING signal_seq
"""

#: A parking run that finds a wake it has not seen goes back in line at once,
#: remembering the wake (and what it waited on) as if it had parked and been woken.
_WOKEN_BEFORE_PARKING_SQL = f"""
UPDATE k2b_run
   SET {
    requeue_set(
        release=False,
        run_after="k2b_now()",
        wait_kind="%s",
        wait_key="%s",
        wait_signal_seq="%s",
        wait_step="%s",
        wait_action="%s",
        wait_deadline="NULL",
        waiting_since="NULL",
        lease_expires_at="NULL",
    )
}, {attempts.SET}
 WHERE id = %s
"""

#: A park is a step's answer, not a failure: the failures before it no longer count.
_PARK_SQL = f"""
UPDATE k2b_run
   SET status = 'waiting', updated_at = k2b_now(),
       wait_kind = %s, wait_key = %s, wait_signal_seq = %s, wait_step = %s, wait_action = %s,
       wait_deadline = %s, waiting_since = k2b_now(), lease_expires_at = NULL,
       {attempts.SET}
 WHERE id = %s
"""

#: Every run parked on the key goes back in line, the wake's number its last seen.
_WAKE_SQL = f"""
UPDATE k2b_run
   SET {requeue_set(release=False, run_after=NOW, wait_signal_seq="%s", wait_deadline="NULL")}
 WHERE status = 'waiting'
   AND app_id = %s AND wait_kind = %s AND wait_key = %s
"""


def _lock_rendezvous(using: str, app_id: str, kind: str, key: str, signal: bool) -> int:
    """Upsert and lock the rendezvous row; with ``signal``, count one more wake."""
    step = 1 if signal else 0
    with connections[using].cursor() as cursor:
        cursor.execute(_UPSERT_SQL, [app_id, kind, key, step, signal, step, signal])
        return cursor.fetchone()[0]


def deadline_at(dependency: Dependency) -> dt.datetime | None:
    deadline = dependency.deadline
    if isinstance(deadline, dt.timedelta):
        return clock.now() + deadline
    if deadline is not None and timezone.is_naive(deadline):
        return timezone.make_aware(deadline)
    return deadline


def park(
    using: str,
    *,
    run_id: uuid.UUID,
    app_id: str,
    step: int,
    dependency: Dependency,
    action: str,
    seen_kind: str,
    seen_key: str,
    seen_seq: int,
    reset: attempts.Reset | None = None,
) -> bool:
    """Park a running run (caller holds its fence) on ``dependency``; ``reset``: the
    claim's reset of the run's failures (``attempts.py``), which a park carries.

    Returns False when a wake the run has not seen is already recorded: the
    run is re-queued at once instead of parked.
    """
    current = _lock_rendezvous(using, app_id, dependency.kind, dependency.key, signal=False)
    same_key = (seen_kind, seen_key) == (dependency.kind, dependency.key)
    already_seen = seen_seq if same_key else 0
    deadline = deadline_at(dependency)
    with connections[using].cursor() as cursor:
        if current > already_seen:
            cursor.execute(
                _WOKEN_BEFORE_PARKING_SQL,
                [
                    dependency.kind,
                    dependency.key,
                    current,
                    step,
                    action,
                    *attempts.params(reset),
                    run_id,
                ],
            )
            return False
        cursor.execute(
            _PARK_SQL,
            [
                dependency.kind,
                dependency.key,
                current,
                step,
                action,
                deadline,
                *attempts.params(reset),
                run_id,
            ],
        )
    return True


def wake(using: str, *, app_id: str, kind: str, key: str) -> int:
    """Record a wake for ``(app_id, kind, key)`` and re-queue every run parked on it.

    Joins the caller's transaction if there is one: nothing happens unless it
    commits. Returns the number of runs re-queued now.
    """
    with transaction.atomic(using=using):
        seq = _lock_rendezvous(using, app_id, kind, key, signal=True)
        with connections[using].cursor() as cursor:
            cursor.execute(_WAKE_SQL, [seq, app_id, kind, key])
            return cursor.rowcount


_NOTIFY_SQL = "SELECT pg_notify(%s, %s)"

#: The payload that wakes workers of every app (a resumed queue, #49). Never a run
#: id; an app named "*" would only wake a little more often.
EVERY_APP = "*"

#: The payload prefix that tells workers a running run was asked to stop (#49), the
#: run's id after it: its worker's lease keeper looks at once, not at its next tick.
#: An app whose id starts so is still woken by it: its workers' keepers only look once more.
CANCEL_NOTICE = "cancel "


def notify(using: str, app_id: str) -> None:
    """Wake idle workers now; delivered only if the surrounding transaction commits."""
    with connections[using].cursor() as cursor:
        cursor.execute(_NOTIFY_SQL, [CHANNEL, app_id])


#: Seconds between two purges by one process: the scan is cheap but need not run every poll.
PURGE_INTERVAL_S = 60.0
_last_purge = 0.0


_PURGE_STALE_SQL = """
DELETE FROM k2b_wait WHERE id IN (
SELECT w.id FROM k2b_wait w
 WHERE COALESCE(w.signaled_at, w.created_at)
       < k2b_now() - %s * interval '1 hour'
   AND NOT EXISTS (
       SELECT 1 FROM k2b_run r
        WHERE r.status = 'waiting' AND r.app_id = w.app_id
          AND r.wait_kind = w.kind AND r.wait_key = w.key)
 LIMIT %s FOR UPDATE SKIP LOCKED)
"""


def purge_stale_rendezvous(using: str, *, force: bool = False, batch: int = 1000) -> int:
    """Delete rendezvous rows whose last wake is older than ``WAKE_RETENTION_HOURS``.

    Every wake leaves a row, even for a key nobody waits on; without this
    only ``purgeworkflows`` would remove them. A row a run is parked on is
    kept whatever its age. Deleting a row forgets its wakes: a waiter that
    parks on the key *after* the retention no longer finds a wake that came
    before it, which is why the retention is long (a week by default).
    ``SKIP LOCKED``: a park or a wake holding the row wins; it is purged later.
    Called from the worker's housekeeping; at most once a minute per process
    unless ``force``.
    """
    global _last_purge
    now = time.monotonic()
    if not force and now - _last_purge < PURGE_INTERVAL_S:
        return 0
    _last_purge = now
    with connections[using].cursor() as cursor:
        cursor.execute(
            _PURGE_STALE_SQL,
            [settings.wake_retention_hours(), batch],
        )
        return cursor.rowcount
