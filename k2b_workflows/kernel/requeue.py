"""The one shape of a re-queue: the SET clause of every UPDATE that puts a run back in line.

A run goes back to ``queued`` from many places (an expired lease, a wait's
deadline or wake, a retry, a hand-back, a deferral, an operator). Written by
hand each time, one of them could forget a column every re-queue must reset
(``run_after``, which the claim orders and filters by; ``updated_at``), or the
release of the holder (``lease_expires_at``, ``claimed_by``) where a worker
held the run: the lease keeper would then renew a run nobody executes, or the
fleet page name a holder that let go. Each statement now says only what
differs: the columns of its case, and whether it releases a holder.
"""

from __future__ import annotations

__all__ = ["AFTER_MS", "NOW", "P", "requeue_set"]

#: Set by every re-queue, whatever else it resets.
_QUEUED = "status = 'queued'"
_TOUCHED = "updated_at = k2b_now()"
#: Set by a re-queue of a run a worker held (or may hold): the lease and the holder go.
_RELEASED = ("lease_expires_at = NULL", "claimed_by = ''")
#: ``run_after`` of a run due at once (the database's clock, which tests may move).
NOW = "k2b_now()"
#: A value passed as a parameter.
P = "%s"
#: ``run_after`` of a run due after a delay, the delay a parameter in milliseconds.
AFTER_MS = "k2b_now() + %s * interval '1 millisecond'"


def requeue_set(*, release: bool, **columns: str) -> str:
    """The SET clause (without ``SET``) of an UPDATE that queues a run again.

    ``columns``: column -> SQL expression, in the order their placeholders take
    their parameters; ``run_after`` is required (when the run may be claimed).
    ``release``: also clear the lease and the holder's name.
    """
    if "run_after" not in columns:
        raise TypeError("a re-queue must say when the run may be claimed (run_after)")
    reserved = {"status", "updated_at"} | ({"lease_expires_at", "claimed_by"} if release else set())
    if clash := reserved & columns.keys():
        raise TypeError(f"a re-queue sets {sorted(clash)} itself")
    parts = [_QUEUED, *(f"{column} = {value}" for column, value in columns.items())]
    if release:
        parts.extend(_RELEASED)
    parts.append(_TOUCHED)
    return ", ".join(parts)
