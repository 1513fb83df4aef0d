"""What happened to an effect in doubt, in words, from the rows the kernel recorded.

The failure this is built around: an incident page that shows "fence 1 -> 2" and
a ledger kind, and an operator who has to know the kernel to read from it that
the worker holding the call was killed. Worse would be a page that guesses:
"the worker crashed" said of a worker that was only frozen, and came back.

So ``what_happened`` turns the rows (the dispatch's ledger entry and those
after it, the run's record of lost leases, the fleet's rows of the workers
named) into sentences, each one only as strong as its rows: which worker held
the call (the dispatch names it), whether it died (its database session is
gone and its heartbeat stale: the takeover's own test), froze (its session is
still there but silent, or it beat again after the takeover) or shut down
(its row says stopped), when the run was taken over and by whom, and at which
step; where the rows do not tell, the sentence says "unknown". It is a pure function, so
the admin's incident box and ``manage.py workflowrun show`` say the same, and
tests feed it the rows of real crashes. ``story_of`` loads those rows.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from django.db import connections

from . import settings
from .kernel import holders
from .models import LedgerEntry, WorkerRecord
from .redaction import redact_text

if TYPE_CHECKING:
    from .models import WorkflowRun

#: Whether a worker is there now, as a takeover asks it: its presence lock held (a
#: killed process's session lets it go at once) or its heartbeat fresh.
_PRESENT_SQL = "SELECT " + holders.present("%(worker)s::text", "%(fresh_ms)s")

#: What each kind of entry after the dispatch says, as the start of a sentence.
_ANSWERS: dict[str, str] = {
    LedgerEntry.Kind.OUTCOME_UNKNOWN: "the outcome was recorded as unknown",
    LedgerEntry.Kind.RECONCILE_UNKNOWN: "the provider could not be asked, or could not tell",
    LedgerEntry.Kind.PENDING: "the provider said the effect is still pending",
    LedgerEntry.Kind.RECONCILED: "the provider was asked and answered",
    LedgerEntry.Kind.LATE_RESULT: "the call came back late, after the run had been taken over",
    LedgerEntry.Kind.SUCCEEDED: "the call returned a result",
    LedgerEntry.Kind.FAILED: "the call failed",
    LedgerEntry.Kind.RESOLVED_CONFIRMED: "an operator recorded the effect as confirmed",
    LedgerEntry.Kind.RESOLVED_ABSENT: "an operator recorded the effect as absent",
    LedgerEntry.Kind.REJECTED: "the call was not made",
}


def when(value: dt.datetime | None) -> str:
    """A time as an operator reads it, in UTC to the second."""
    if value is None:
        return "an unknown time"
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def worker_words(worker_id: str, workers: Mapping[str, WorkerRecord]) -> str:
    """A worker as its row names it: its id, host and process id, or what is unknown."""
    if not worker_id:
        return "a worker the rows do not name (unknown)"
    row = workers.get(worker_id)
    if row is None:
        return f"worker {worker_id} (host and pid unknown: its row is gone)"
    return f"worker {worker_id} (host {row.host}, pid {row.pid})"


def step_words(run: WorkflowRun, dispatch: LedgerEntry) -> str:
    """The step, named by its task path for a task call, by its action otherwise."""
    name = run.task_path or dispatch.action_name or "unknown action"
    kind = "task" if run.task_path else "action"
    return f"step {dispatch.seq} ({kind} {name})"


def _fate(holder: WorkerRecord | None, taken_at: dt.datetime | None, present: bool | None) -> str:
    """Whether the holder died, froze or shut down, as far as its rows tell.

    ``present``: whether the worker is there now by the takeover's own test
    (``kernel.holders.present``: its presence lock held or its heartbeat fresh);
    None: not asked.
    """
    if holder is None:
        return "Whether it died or froze is unknown: its row in the fleet is gone."
    if taken_at is not None and holder.heartbeat_at > taken_at:
        return (
            f"It had not died: it beat again at {when(holder.heartbeat_at)}, after the "
            "takeover, so it had frozen (or lost the database) for longer than its lease."
        )
    if holder.state == WorkerRecord.State.STOPPED:
        return f"It had shut down: its row says stopped at {when(holder.stopped_at)}."
    if present is False:
        return (
            f"It died: its process is gone (its database session ended) and its last "
            f"heartbeat was at {when(holder.heartbeat_at)}."
        )
    if present is True:
        return (
            f"It is frozen: its process is still there but has not beaten since "
            f"{when(holder.heartbeat_at)}."
        )
    return (
        "Whether it died or froze is unknown; its last heartbeat was at "
        f"{when(holder.heartbeat_at)}."
    )


def what_happened(
    run: WorkflowRun,
    ledger: Sequence[LedgerEntry],
    workers: Mapping[str, WorkerRecord],
    present: Mapping[str, bool],
) -> list[str]:
    """Sentences saying what became of the effect in doubt of ``run``, from its rows.

    ``ledger``: the entries of the step in doubt, oldest first; ``workers``: the
    fleet's rows by worker id; ``present``: whether each is there now, by the
    takeover's own test (``kernel.holders.present``). Empty when the run has
    no dispatched effect in doubt (an incident about the code, not an effect).
    """
    step = run.attention_step
    dispatches = [e for e in ledger if e.seq == step and e.kind == LedgerEntry.Kind.DISPATCHED]
    if step is None or not dispatches:
        return []
    dispatch = dispatches[-1]
    after = [e for e in ledger if e.seq == step and e.pk is not None and e.pk > dispatch.pk]
    holder_id = str((dispatch.detail or {}).get("worker", ""))
    sentences = [
        f"At {when(dispatch.created_at)} {worker_words(holder_id, workers)} started the call "
        f"of {step_words(run, dispatch)}, under fence {dispatch.generation}."
    ]
    # The first entry written under a later fence is the first thing another
    # claim of the run did: the takeover.
    takeover = next(
        (
            e
            for e in after
            if e.generation is not None
            and dispatch.generation is not None
            and e.generation > dispatch.generation
        ),
        None,
    )
    lost_by = [str(w) for w in (run.lease_lost_by or [])]
    if holder_id and holder_id in lost_by:
        if takeover is None:
            sentences.append(
                "Its lease expired and the run was taken from it; when, and by whom, is "
                "unknown: no later entry of this step records it."
            )
        else:
            taker = (
                f" by {worker_words(run.claimed_by, workers)}"
                if run.claimed_by and takeover.generation == run.generation
                else " (by which worker is unknown)"
            )
            sentences.append(
                f"Its lease expired without an answer from the call, and at "
                f"{when(takeover.created_at)} the run was taken over{taker}, under fence "
                f"{takeover.generation}."
            )
        sentences.append(
            _fate(
                workers.get(holder_id),
                takeover.created_at if takeover else None,
                present.get(holder_id),
            )
        )
    elif takeover is not None:
        sentences.append(
            f"At {when(takeover.created_at)} the run was under fence {takeover.generation}; "
            "whether the worker of the call lost its lease is unknown: the run does not "
            "record it among the workers that lost one."
        )
    else:
        sentences.append("The worker of the call kept its lease until the outcome was recorded.")
    for entry in after:
        said = _ANSWERS.get(entry.kind)
        if said is None:
            continue
        by = f" by {entry.actor}" if entry.actor else ""
        message = f": {redact_text(entry.message)}" if entry.message else ""
        sentences.append(f"At {when(entry.created_at)}{by} {said}{message}.")
    return sentences


def story_of(run: WorkflowRun, using: str | None = None) -> list[str]:
    """``what_happened`` for ``run``, from the rows as they are now."""
    using = using or run._state.db or settings.database()
    if run.attention_step is None:
        return []
    ledger = list(
        LedgerEntry.objects.using(using)
        .filter(run_id=run.pk, seq=run.attention_step)
        .order_by("id")
    )
    named: set[str] = {str(w) for w in (run.lease_lost_by or [])}
    named.update(str((e.detail or {}).get("worker", "")) for e in ledger)
    named.add(run.claimed_by)
    named.discard("")
    workers = {
        w.worker_id: w for w in WorkerRecord.objects.using(using).filter(worker_id__in=named)
    }
    present: dict[str, bool] = {}
    with connections[using].cursor() as cursor:
        for worker_id in named:
            cursor.execute(
                _PRESENT_SQL, {"worker": worker_id, "fresh_ms": settings.worker_fresh_ms()}
            )
            present[worker_id] = bool(cursor.fetchone()[0])
    return what_happened(run, ledger, workers, present)
