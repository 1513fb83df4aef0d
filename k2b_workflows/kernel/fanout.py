"""A children step: create a step's child runs once, then wait for all of them.

``run.children`` and ``create_child_workflow_runs`` are steps of the parent
like any other, journaled at their position; what makes them a kind of their
own is one transaction that fences the parent, creates the children that do
not exist yet (``starts.start_children``: idempotent by parent, step and index), and
either journals their results (all ended, or not waited for) or parks the
parent until the last one ends and wakes it (``children.wake_parent``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from .. import codes, settings, validation
from ..actions import Action, Effect, Succeeded
from ..exceptions import InvalidInput, UnknownWorkflow
from ..models import JournalEntry
from ..workflows import ChildResult, WorkflowDefinition
from . import budgets, children, db, evidence, seals, starts, waits
from .ending import RunEnding
from .journal import Claim, RunJournal, Step

KIND = children.KIND


class ChildrenAction(Action):
    """The action name a children step is journaled under (``k2b.children:<name>``)."""

    name = KIND
    effect = Effect.PURE


_CHILDREN_ACTION = ChildrenAction()


class Parent(Claim, Protocol):
    """What a children step asks of the execution it is a step of (``execute.Execution``):
    a protocol, so that the kernel's steps never import the executor."""

    journal: RunJournal
    ending: RunEnding
    definition: WorkflowDefinition
    next_seq: int

    def check_shutdown(self) -> None: ...

    def check_parked_step(self, seq: int, name: str, input_hash: str) -> None: ...

    def stop_if_asked(self, seq: int) -> None: ...

    def replay_marker(self, entry: JournalEntry, name: str, input: Any, input_hash: str) -> Any: ...

    def marker_step(
        self, seq: int, action: Action, name: str, input: Any, input_hash: str
    ) -> Step: ...


@dataclass
class _Written:
    """What the children step's transaction found (applied only after it commits)."""

    entry: JournalEntry | None = None
    #: The entry's output: the children's results, or their ids when not waited for.
    output: list[dict[str, Any]] = field(default_factory=list)
    parked: bool = False
    failure: tuple[str, str] | None = None
    tampered: str | None = None


def action_name(name: str, *, wait: bool) -> str:
    """The journal's name for a children step of workflow ``name``."""
    return f"{KIND}:{name}" if wait else f"{KIND}.create:{name}"


def replayed(output: list[dict[str, Any]], *, wait: bool) -> list[Any]:
    """What the workflow code gets from a journaled children step."""
    if not wait:
        return [r["run_id"] for r in output]
    return [ChildResult(**r) for r in output]


class ChildrenStep:
    """A new children step of one claimed parent run."""

    def __init__(self, claim: Claim, journal: RunJournal, ending: RunEnding) -> None:
        self.claim = claim
        self.journal = journal
        self.ending = ending

    def run(self, step: Step, name: str, *, wait: bool, max_steps: int) -> list[Any]:
        """Create the children of ``step`` and journal their results, or park the parent."""
        inputs = step.input
        if step.seq >= max_steps:  # a children call is a step of the loop budget too
            self.journal.step_failed(
                step,
                codes.MAX_STEPS_EXCEEDED,
                f"step {step.seq} is past max_steps={max_steps}",
            )
        if len(inputs) > settings.max_children_per_step():
            self.journal.step_failed(
                step,
                codes.FAN_OUT_EXCEEDED,
                f"{len(inputs)} children asked,"
                f" at most {settings.max_children_per_step()} per step",
            )
        written = db.run_in_transaction(lambda: self._write(step, name, wait), self.claim.using)
        if written.tampered is not None:
            self.ending.chain_broken(written.tampered)
        if written.failure is not None:
            self.journal.step_failed(step, *written.failure)
        if written.entry is None:
            self.ending.parked(step.seq, written.parked)
        self.journal.journaled(written.entry)
        return replayed(written.output, wait=wait)

    def _write(self, step: Step, name: str, wait: bool) -> _Written:
        claim, using, seq = self.claim, self.claim.using, step.seq
        written = _Written()
        run = claim.run
        self.journal.fence(seq)
        try:
            ids = starts.start_children(using, parent=run, step=seq, name=name, inputs=step.input)
        except budgets.BudgetExceeded as exc:
            written.failure = (exc.code, str(exc))
            return written
        except UnknownWorkflow as exc:
            written.failure = ("UNKNOWN_WORKFLOW", str(exc))
            return written
        try:
            rows = children.results(using, claim.run_id, seq)
        except seals.SealBroken as exc:
            written.tampered = str(exc)
            return written
        if not wait or all(r["done"] for r in rows):
            output = (
                [children.public(r) for r in rows] if wait else [{"run_id": str(i)} for i in ids]
            )
            entry = self.journal.new_entry(step, JournalEntry.State.SUCCEEDED, Succeeded(output))
            evidence.append_journal(entry, self.journal.last_hash, using)
            written.entry = entry
            written.output = output
            return written
        written.parked = waits.park(
            using,
            run_id=claim.run_id,
            app_id=claim.app_id,
            step=seq,
            dependency=children.dependency(claim.run_id, seq),
            action=step.name,
            seen_kind=run.wait_kind,
            seen_key=run.wait_key,
            seen_seq=run.wait_signal_seq,
            reset=self.journal.reset,
        )
        return written


def children_step(parent: Parent, name: str, inputs: list[Any], *, wait: bool = True) -> Any:
    """``run.children`` (``wait``) or ``create_child_workflow_runs(run, ...)`` (not)."""
    parent.stop_if_asked(parent.next_seq)
    parent.journal.flush_pending()
    parent.check_shutdown()
    seq = parent.next_seq
    parent.next_seq += 1
    journaled_as = action_name(name, wait=wait)
    try:
        inputs = validation.child_inputs(inputs, f"inputs of children step {seq}")
    except (InvalidInput, TypeError) as exc:
        parent.ending.fail(codes.INVALID_STEP_INPUT, str(exc))
    input_hash = evidence.hash_value(inputs)
    entry = parent.journal.get(seq)
    if entry is None:
        parent.check_parked_step(seq, journaled_as, input_hash)
    else:
        output = parent.replay_marker(entry, journaled_as, inputs, input_hash)
        return replayed(output, wait=wait)
    step = parent.marker_step(seq, _CHILDREN_ACTION, journaled_as, inputs, input_hash)
    return ChildrenStep(parent, parent.journal, parent.ending).run(
        step, name, wait=wait, max_steps=parent.definition.max_steps
    )
