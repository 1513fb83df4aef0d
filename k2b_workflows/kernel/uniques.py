"""Unique keys of runs: one run per key, held by a constraint, not by a look first.

The failure this is built around: "look for a run with this key, insert one
if there is none" lets two concurrent transactions both look, both find
nothing and both insert; a lock taken to fix that (an advisory lock, a row
locked in a second table) is held by a transaction that may roll back, and
the designs that skip on a held lock drop the second call with the first
(oban #1087). Here the run carries its key (``unique_key``) under the
partial unique index ``k2b_run_unique_key`` over the runs that hold it
(``models.UNIQUE_HELD``). A start inserts with ``ON CONFLICT DO NOTHING``
(no target: POSTGRES-FACTS, "Dedup tables with two unique constraints"): a
second insert of a key waits for the first one's transaction and, if it
committed, inserts nothing and reads that run (``holder``); if it rolled
back, the second inserts its own. No run is ever updated into holding a key
(a run holds it from its insert until it leaves its states, and never comes
back: an operator's retry of a run that let it go keeps it let go, see
``interventions``), so no claim, end or retry can fail on the index.

Two writes to another call's run, each under that run's lock and checked
again there: a holder enqueued ``period`` or longer ago lets its key go
(``LET_GO_SQL``) so that the new call inserts its own; a READY holder takes
a ``replace`` or ``debounce`` call's arguments, re-sealed by the kernel
(``change``). A running holder is never changed: the change is conditional
on the run being queued and never claimed, under the row lock a claim's
``SKIP LOCKED`` passes by.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

from django.db import transaction

from .. import settings
from ..exceptions import InvalidInput
from ..models import WorkflowRun
from ..unique import Unique
from . import db, seals

logger = logging.getLogger(__name__)

#: ``models.UNIQUE_HELD`` in SQL: where a run holds its key.
HELD_SQL = """unique_key IS NOT NULL AND (
       (status = 'queued' AND generation = 0)
    OR (unique_states >= 2 AND (status IN ('running', 'waiting', 'needs_attention')
                                OR (status = 'queued' AND generation > 0)))
    OR (unique_states IN (3, 5) AND status = 'succeeded')
    OR (unique_states IN (4, 5) AND status IN ('failed', 'canceled')))"""

#: The run holding a key, committed (or this transaction's own): through the index.
HOLDER_SQL = f"SELECT * FROM k2b_run WHERE unique_key = %s AND {HELD_SQL}"

#: A holder enqueued ``period`` or longer ago lets its key go; under its row lock, so
#: two calls that both found it expired let it go once (the second finds it let go).
LET_GO_SQL = (
    "UPDATE k2b_run SET unique_key = NULL WHERE id = %s AND unique_key = %s AND created_at <= %s"
)

#: How often a start tries again when the holder it waited for was gone by the time
#: it looked (ended, or let go): each round waits for a transaction that took the key.
MAX_ROUNDS = 20

#: Workflow name -> how a READY run's input takes a later call's (``tasks.runs``): a
#: task run's input keeps its task's part and takes the call's arguments (and, with
#: ``replace``, its priority). Any other workflow's run takes the new input whole.
REPLACED_INPUT: dict[str, Callable[[Any, Any, bool], Any]] = {}


class UniqueKeyNotSealed(InvalidInput):
    """The run holding a unique key has start fields that do not match their seal:
    neither returned to the caller nor re-sealed with the new call's arguments."""


@dataclasses.dataclass(slots=True)
class Claim:
    """One start's unique key (the declaration and the key it computed), and what the
    start found: ``matched``, the run that held the key, when the start inserted none
    (the caller then sends no ``task_enqueued``)."""

    unique: Unique
    key: str
    matched: WorkflowRun | None = None
    #: The call's priority (the kernel's) and ``run_after``: what ``replace`` gives.
    offer: tuple[int, dt.datetime | None] = (0, None)

    @property
    def columns(self) -> dict[str, Any]:
        return {"unique_key": self.key, "unique_states": self.unique.states_code}

    def first_run_after(self, run_after: dt.datetime | None, now: dt.datetime) -> Any:
        """A debounced call's first run waits its debounce (or its own ``run_after``)."""
        debounce = self.unique.debounce
        if debounce is None:
            return run_after
        return max(run_after or now, now + debounce)


def holder(using: str, claim: Claim, now: dt.datetime) -> WorkflowRun | None:
    """The run holding ``claim``'s key, or None: no run holds it (any more), or the
    one that did was enqueued ``period`` or longer ago and has let it go now."""
    found = next(iter(WorkflowRun.objects.raw(HOLDER_SQL, [claim.key]).using(using)), None)
    if found is None:
        return None
    period = claim.unique.period
    if period is not None and found.created_at <= now - period:
        # Let go here, or by a concurrent call first: either way the caller inserts
        # again, and meets the run that took the key since, if one did.
        db.execute(using, LET_GO_SQL, [found.pk, claim.key, now - period])
        return None
    return found


def change(
    using: str,
    found: WorkflowRun,
    claim: Claim,
    *,
    input: Any,
    priority: int,
    run_after: dt.datetime | None,
    now: dt.datetime,
) -> WorkflowRun:
    """``found`` after a ``replace`` or ``debounce`` call: a READY run takes the call's
    input (``REPLACED_INPUT``), with ``replace`` its priority and ``run_after``, with
    ``debounce`` a ``run_after`` of now + debounce capped at its enqueue + ``max_wait``;
    re-sealed as a start is. Any other run is returned unchanged."""
    unique = claim.unique
    if not (unique.replace or unique.debounce is not None) or not _ready(found):
        return found
    with transaction.atomic(using=using):
        return _change(using, found, claim, input, priority, run_after, now)


def _change(
    using: str,
    found: WorkflowRun,
    claim: Claim,
    input: Any,
    priority: int,
    run_after: dt.datetime | None,
    now: dt.datetime,
) -> WorkflowRun:
    """``change`` under the run's lock: a claim's ``SKIP LOCKED`` passes it by meanwhile."""
    unique = claim.unique
    locked = WorkflowRun.objects.using(using).select_for_update().filter(pk=found.pk).first()
    if locked is None or not _ready(locked) or locked.unique_key != claim.key:
        return locked or found  # claimed (or let go) since it was read: left as it is
    problem = seals.start_problem(locked)
    if problem is not None:
        logger.error("run %s holds unique key %s: %s", locked.pk, claim.key, problem)
        raise UniqueKeyNotSealed(f"run {locked.pk}, which holds this call's unique key: {problem}")
    merge = REPLACED_INPUT.get(locked.workflow_name)
    locked.input = input if merge is None else merge(locked.input, input, unique.replace)
    if unique.replace:
        locked.priority = priority
        locked.priority_credit_ms = priority * settings.priority_aging_ms()
        locked.run_after = max(run_after or now, now)
    if unique.debounce is not None:
        until = now + unique.debounce
        if unique.max_wait is not None:
            until = min(until, locked.created_at + unique.max_wait)
        locked.run_after = max(until, now)
    locked.updated_at = now
    locked.start_seal = seals.start_seal(locked)
    changed = ("input", "priority", "priority_credit_ms", "run_after", "updated_at", "start_seal")
    WorkflowRun.objects.using(using).filter(pk=locked.pk, status="queued", generation=0).update(
        **{name: getattr(locked, name) for name in changed}
    )
    return locked


def _ready(run: WorkflowRun) -> bool:
    """Queued and never claimed: READY, the only state a later call may change."""
    return run.status == "queued" and run.generation == 0
