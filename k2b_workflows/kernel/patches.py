"""``run.patched`` and ``run.deprecate_patch``: the journal's patch markers.

A patch marker is a step of the kernel's own, journaled at the run's next
position, that lets changed workflow code branch on whether a run reached that
point under it. Kept out of the executor: deciding whether a run may take the
new branch reads the journal, the ledger and the tables where a step leaves a
trace, none of which the executor otherwise needs.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from ..actions import Action, Effect, Succeeded
from ..exceptions import InvalidInput
from . import db, divergence, evidence

if TYPE_CHECKING:
    from ..models import JournalEntry, WorkflowRun
    from .journal import RunJournal, Step

PATCH_KIND = divergence.PATCH_KIND

#: Whether step ``seq`` left a trace outside the journal and ledger before this claim.
STARTED_BEFORE_SQL = """
SELECT EXISTS (SELECT 1 FROM k2b_budget_charge WHERE run_id = %s AND seq = %s)
    OR EXISTS (SELECT 1 FROM k2b_ai_task WHERE run_id = %s AND seq = %s)
    OR EXISTS (SELECT 1 FROM k2b_run WHERE parent_id = %s AND parent_step = %s)
"""


class Execution(Protocol):
    """What a patch marker asks of the execution it is a step of (``execute.Execution``):
    a protocol, so that the kernel's steps never import the executor."""

    run_id: uuid.UUID
    using: str
    run: WorkflowRun
    journal: RunJournal
    next_seq: int

    def check_shutdown(self) -> None: ...

    def diverged(self, entry: JournalEntry, name: str, input_hash: str) -> NoReturn: ...

    def marker_step(
        self, seq: int, action: Action, name: str, input: Any, input_hash: str
    ) -> Step: ...

    def journal_marker(self, step: Step, result: Succeeded) -> Any: ...


class PatchAction(Action):
    """What the journal records for a patch marker."""

    name = PATCH_KIND
    effect = Effect.PURE


def patched(execution: Execution, patch_id: str) -> bool:
    """``run.patched``: True for a run at this point under the new code, journaled."""
    if not isinstance(patch_id, str) or not patch_id:
        raise InvalidInput("patched() takes a non-empty patch id")
    execution.journal.flush_pending()
    execution.check_shutdown()
    seq = execution.next_seq
    marker = f"{PATCH_KIND}:{patch_id}"
    entry = execution.journal.get(seq)
    if entry is not None:
        if entry.action_name == marker:
            execution.next_seq += 1
            return True
        if entry.action_name.startswith(f"{PATCH_KIND}:"):
            execution.diverged(entry, marker, entry.input_hash)
        return False  # the journal shows a step of the old code at this point
    if _started_before(execution, seq):
        return False  # step ``seq`` began under the old code (an effect, a wait)
    execution.next_seq += 1
    step = execution.marker_step(seq, PatchAction(), marker, None, evidence.hash_value(None))
    execution.journal_marker(step, Succeeded(True, summary=f"took patch {patch_id}"))
    return True


def deprecate_patch(execution: Execution, patch_id: str) -> None:
    """``run.deprecate_patch``: consume the marker where the run has one; journal nothing."""
    if not isinstance(patch_id, str) or not patch_id:
        raise InvalidInput("deprecate_patch() takes a non-empty patch id")
    entry = execution.journal.get(execution.next_seq)
    if entry is not None and entry.action_name == f"{PATCH_KIND}:{patch_id}":
        execution.next_seq += 1


def _started_before(execution: Execution, seq: int) -> bool:
    """Did step ``seq`` leave a trace before this claim: ledger, charge, wait, child, AI task?

    Such a run met this point under the old code; taking a new branch now
    could skip an effect the old step may already have caused.
    """
    run = execution.run
    if seq in execution.journal.effects or seq in (run.current_step, run.wait_step):
        return True
    rows = db.fetchall(execution.using, STARTED_BEFORE_SQL, [execution.run_id, seq] * 3)
    return bool(rows[0][0])
