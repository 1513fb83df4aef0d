"""State changes of runs and steps, told once to the log and to the metrics.

Why a module of its own: an operator reading logs after an incident needs
every change of a run with the same fields (``run_id``, ``workflow``,
``step``, ``generation``, ``effect_key``) as structured ``extra``, so that a
JSON formatter or a log search can follow one run or one effect across
workers. Only committed changes are told: the executor calls these after its
transaction commits (ledger entries through ``on_commit``), so a rolled-back
write never appears as having happened.

Logger: ``k2b_workflows.events`` (INFO for progress, WARNING for doubt).
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any, Protocol

from django.db import transaction

from .. import counters

if TYPE_CHECKING:
    from ..models import JournalEntry


class Execution(Protocol):
    """What these functions read of the execution they tell about (its run, when loaded)."""

    run_id: uuid.UUID
    generation: int


#: Named, not ``__name__``: docs/operations.md tells operators to configure this name.
logger = logging.getLogger("k2b_workflows.events")

#: Ledger kinds that leave an effect in doubt: logged as warnings.
_DOUBT = {"outcome_unknown", "reconcile_unknown", "late_result"}


def _extra(execution: Execution, step: int | None, effect_key: str = "", **more: Any) -> dict:
    # ``workflow``: a task call's task path (#51); its workflow (``k2b.task.<effect>``)
    # is the same for every task, and a log search by task found nothing.
    run = getattr(execution, "run", None)
    return {
        "run_id": str(execution.run_id),
        "workflow": run.display_name if run is not None else "",
        "step": step,
        "generation": execution.generation,
        "effect_key": effect_key or (f"{execution.run_id}:{step}" if step is not None else ""),
        **more,
    }


def _log(
    level: int,
    execution: Execution,
    step: int | None,
    message: str,
    *args: Any,
    effect_key: str = "",
    **more: Any,
) -> None:
    """Log with the structured fields, built only if the level is on: every step passes here."""
    if logger.isEnabledFor(level):
        logger.log(level, message, *args, extra=_extra(execution, step, effect_key, **more))


def run_claimed(execution: Execution, worker_id: str = "") -> None:
    _log(
        logging.INFO,
        execution,
        None,
        "run %s claimed (generation %s)",
        execution.run_id,
        execution.generation,
        event="claimed",
        worker_id=worker_id,
    )


def step_journaled(execution: Execution, entry: JournalEntry) -> None:
    """A journal entry committed: the step succeeded or failed for good."""
    seconds = None
    if entry.started_at and entry.created_at:
        seconds = (entry.created_at - entry.started_at).total_seconds()
    counters.count_step(entry.effect, entry.state, seconds)
    _log(
        logging.INFO,
        execution,
        entry.seq,
        "run %s step %s (%s) %s",
        execution.run_id,
        entry.seq,
        entry.action_name,
        entry.state,
        event=f"step_{entry.state}",
        action=entry.action_name,
        effect=entry.effect,
        error_code=entry.error_code,
    )


def ledger_written(
    execution: Execution,
    using: str,
    *,
    seq: int,
    kind: str,
    effect: str,
    effect_key: str,
    committed: bool = False,
) -> None:
    """A ledger entry was written in the current transaction: tell it once that commits.

    ``committed``: its transaction has committed already (a batch): tell it now,
    without asking Django's connection handler, a cost per entry.
    """

    def told() -> None:
        if kind == "outcome_unknown":
            counters.count_step(effect, "outcome_unknown")
        _log(
            logging.WARNING if kind in _DOUBT else logging.INFO,
            execution,
            seq,
            "run %s step %s effect %s",
            execution.run_id,
            seq,
            kind,
            effect_key=effect_key,
            event=f"effect_{kind}",
            effect=effect,
        )

    if committed:
        told()
    else:
        transaction.on_commit(told, using=using)


def run_changed(
    execution: Execution, outcome: str, step: int | None = None, reason: str = ""
) -> None:
    """The run's status changed (committed): succeeded, failed, waiting, retry, ...

    ``reason`` is the run's stored error text, already scrubbed of credentials.
    """
    counters.count_run_transition(outcome)
    trace = getattr(execution, "trace", None)
    if trace is not None:
        trace.event(f"k2b.run.{outcome}", {} if step is None else {"k2b.step": step})
    _log(
        logging.WARNING if outcome in ("needs_attention", "failed") else logging.INFO,
        execution,
        step,
        "run %s -> %s%s",
        execution.run_id,
        outcome,
        f" ({reason})" if reason else "",
        event=f"run_{outcome}",
    )


def reconcile_answered(execution: Execution, seq: int, effect_key: str, answer: str) -> None:
    counters.count_reconcile_answer(answer)
    trace = getattr(execution, "trace", None)
    if trace is not None:
        trace.event("k2b.reconcile", {"k2b.step": seq, "k2b.reconcile.answer": answer})
    _log(
        logging.INFO,
        execution,
        seq,
        "run %s step %s reconcile answered %s",
        execution.run_id,
        seq,
        answer,
        effect_key=effect_key,
        event="reconcile",
        answer=answer,
    )
