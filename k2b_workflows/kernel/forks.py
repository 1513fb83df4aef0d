"""Forks: a new run that keeps an ended run's journal up to a step and runs on from there.

The failures this module is built around, each seen in a peer's "reset" or
"replay": a reset that re-ran completed children three times, a replay that
turned a failure into a success, a replay that duplicated a task's input, and
the one no replay may do here, an external effect repeated because someone
clicked "re-run from here".

- The fork is a new run, built by ``starts.start`` like any other (sealed,
  anchored, its own budget account) with the original's input as stored: one
  input, never the input plus what the steps made of it. Its ``forked_from``
  links it to the original (covered by its start seal), and the original's
  ``forks`` lists it.
- The steps before the fork point are copied as they were recorded, failures
  as failures, and written by the kernel's own journal writer
  (``evidence.append_journal``): chained and anchored for the new run, never
  rows copied raw, so the fork verifies as any run does. A children step among
  them replays its recorded children; none is created again.
- A step at or after the fork point whose EXTERNAL, IRREVERSIBLE or
  SNAPSHOT_RESTORE effect was dispatched (and so may have happened), or a
  children step whose child runs dispatched one, refuses the fork
  (``ForkRefused``) unless the operator names it in ``repeat_effects``; the
  fork's "forked" ledger entry records who allowed it and why.
- An IDEMPOTENT step at or after the fork point runs again with the effect
  key the original used (``inherited_keys``), so the provider answers with
  what it did, unless it is named in ``repeat_effects``: then a key of the
  fork's own. A key is kept only for the same action at the same position: a
  step the new code put there is another call.

Only an ended run is forked (succeeded, failed or canceled): a run that may
still act (queued, running, waiting, or waiting for an operator, whose
decision re-queues it) would act beside its fork on the same effects.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from ..actions import Effect
from ..exceptions import ForkRefused, InvalidInput
from ..models import JournalEntry, LedgerEntry, RunStatus, WorkflowRun
from . import clock, db, evidence, instances, seals, starts
from .journal import CLOSING_KINDS

#: A run that can no longer act: its fork is the only run going on from its steps.
FORKABLE_STATUSES = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELED)
#: Copied journal entries per statement: fifteen parameters each, far below PostgreSQL's
#: 65,535, and few distinct statement texts for psycopg to prepare.
COPY_BATCH = 200
#: ``from_step="failure"``: the step at which a failed run failed.
FAILURE = "failure"

#: The effect classes whose dispatch may have happened: never repeated unasked.
_EXTERNAL = frozenset(e.value for e in Effect if e.is_external)
#: The child runs (at any depth) of the original's children steps at or after the
#: fork point that dispatched an external effect, by the parent's step. Walks the
#: tree through ``k2b_run_child_once`` (parent, parent_step, child_index).
CHILD_DISPATCHES_SQL = """
WITH RECURSIVE tree AS (
    SELECT id, parent_step AS step FROM k2b_run WHERE parent_id = %s AND parent_step >= %s
    UNION ALL
    SELECT r.id, t.step FROM k2b_run r JOIN tree t ON r.parent_id = t.id)
SELECT t.step, array_agg(DISTINCT t.id::text ORDER BY t.id::text)
  FROM tree t
 WHERE EXISTS (SELECT 1 FROM k2b_ledger l WHERE l.run_id = t.id AND l.kind = 'dispatched')
 GROUP BY t.step
 ORDER BY t.step
"""


@dataclass
class Plan:
    """What a fork of a run from a step would do, read from the run's evidence."""

    run: WorkflowRun
    journal: list[JournalEntry]
    ledger: list[LedgerEntry]
    #: The fork point: the first step the fork runs rather than replays.
    seq: int
    #: The steps at or after it whose external effect may have happened (``at_risk``).
    at_risk: list[dict[str, Any]]

    def idempotent_steps(self) -> list[JournalEntry]:
        """The IDEMPOTENT steps at or after the fork point: they keep their effect keys
        unless named in ``repeat_effects``."""
        return [e for e in self.journal[self.seq :] if e.effect == Effect.IDEMPOTENT.value]


def plan(using: str, run_id: uuid.UUID, from_step: int | str) -> Plan:
    """Read ``run_id`` and what a fork of it from ``from_step`` would repeat; writes nothing.

    Raises ``WorkflowRun.DoesNotExist`` or ``InvalidInput`` (a run that may
    still act, a step that is not one of the run's, broken evidence). Inside
    ``fork``, under the run's row lock; the admin's form reads it without one
    to show the operator, and the fork itself reads it again.
    """
    original = WorkflowRun.objects.using(using).filter(pk=run_id).first()
    if original is None:
        raise WorkflowRun.DoesNotExist(f"no run {run_id}")
    if original.status not in FORKABLE_STATUSES:
        raise InvalidInput(
            f"run {run_id} is {original.status}: only a run that ended (succeeded, failed"
            " or canceled) is forked; cancel it first if it should not go on"
        )
    journal = list(JournalEntry.objects.using(using).filter(run_id=run_id).order_by("seq"))
    ledger = list(LedgerEntry.objects.using(using).filter(run_id=run_id).order_by("id"))
    broken = seals.start_problem(original) or evidence.verify_run(original, journal, ledger)
    if broken is not None:
        raise InvalidInput(f"run {run_id}: its evidence does not verify ({broken}): not forked")
    if [e.seq for e in journal] != list(range(len(journal))):
        raise InvalidInput(f"run {run_id}: its journal has gaps: not forked")
    seq = fork_point(original, journal, from_step)
    return Plan(original, journal, ledger, seq, at_risk(using, run_id, seq, journal, ledger))


def fork(
    using: str,
    run_id: uuid.UUID,
    *,
    from_step: int | str,
    actor: str,
    actor_id: int | None,
    reason: str,
    repeat_effects: Iterable[int],
    version: int | None,
) -> WorkflowRun:
    """Fork ``run_id`` from ``from_step`` (see ``control.fork_workflow_run``).

    Under the original's row lock, so that nothing is appended to it while its
    chains are read, checked and copied. Raises ``WorkflowRun.DoesNotExist``,
    ``InvalidInput`` (see ``plan``) or ``ForkRefused``; nothing is written then.
    """
    from ..workflows import get_workflow

    with transaction.atomic(using=using):
        if db.lock_run(using, run_id) is None:
            raise WorkflowRun.DoesNotExist(f"no run {run_id}")
        planned = plan(using, run_id, from_step)
        original, journal, seq = planned.run, planned.journal, planned.seq
        repeat = repeat_steps(run_id, seq, len(journal), repeat_effects)
        refused = [step for step in planned.at_risk if step["seq"] not in repeat]
        # The guard: an effect that may have happened runs again only when named.
        if refused:
            raise ForkRefused(run_id, refused)
        definition = get_workflow(original.workflow_name, version)
        keys = kept_keys(original, journal, planned.ledger, seq, repeat)
        fork_run = starts.start(
            using,
            definition,
            original.input,
            principal=original.principal,
            concurrency_key=original.concurrency_key if definition.concurrency else None,
            priority=original.priority,
            queue=original.queue,
            forked_from=original.pk,
        )
        now = clock.now()
        copied = [
            instances.fresh(
                JournalEntry,
                {
                    "run_id": fork_run.pk,
                    "seq": entry.seq,
                    "action_name": entry.action_name,
                    "effect": entry.effect,
                    "state": entry.state,
                    "output": entry.output,
                    "summary": entry.summary,
                    "error_code": entry.error_code,
                    "error_message": entry.error_message,
                    "input_hash": entry.input_hash,
                    "generation": 0,
                    "started_at": entry.started_at,
                    "created_at": now,
                },
            )
            for entry in journal[:seq]
        ]
        prev = evidence.GENESIS
        for start in range(0, len(copied), COPY_BATCH):
            prev = evidence.append_journals(copied[start : start + COPY_BATCH], prev, using)
        repeated = [step for step in planned.at_risk if step["seq"] in repeat]
        evidence.append_ledger(
            using,
            run_id=fork_run.pk,
            kind=LedgerEntry.Kind.FORKED,
            actor=actor,
            actor_id=actor_id,
            message=reason,
            detail={
                "forked_from": str(original.pk),
                "from_step": seq,
                "workflow_version": definition.version,
                "repeat_effects": sorted(repeat),
                "repeated": repeated,
                "keys": {str(s): k for s, k in sorted(keys.items())},
            },
        )
        evidence.append_ledger(
            using,
            run_id=original.pk,
            kind=LedgerEntry.Kind.FORKED,
            actor=actor,
            actor_id=actor_id,
            message=reason,
            detail={"fork": str(fork_run.pk), "from_step": seq, "repeat_effects": sorted(repeat)},
        )
    return WorkflowRun.objects.using(using).get(pk=fork_run.pk)


def fork_point(run: WorkflowRun, journal: list[JournalEntry], from_step: int | str) -> int:
    """The position ``from_step`` names: a journaled step's ``seq``, the step a run that
    did not succeed stopped at (the journal's length), or ``"failure"``."""
    stopped = len(journal)
    if from_step == FAILURE:
        if run.status != RunStatus.FAILED:
            raise InvalidInput(f'from_step="failure": run {run.pk} is {run.status}, not failed')
        # A failure journaled last is the step that failed (replaying it would fail
        # again); otherwise the run failed at the step it had reached.
        if journal and journal[-1].state == JournalEntry.State.FAILED:
            return journal[-1].seq
        return stopped
    if isinstance(from_step, bool) or not isinstance(from_step, int):
        raise InvalidInput(f'from_step must be a step\'s seq or "failure", not {from_step!r}')
    last = stopped - 1 if run.status == RunStatus.SUCCEEDED else stopped
    if not 0 <= from_step <= last:
        raise InvalidInput(
            f"from_step {from_step} is not a step of run {run.pk}: its steps are 0 to {last}"
        )
    return from_step


def repeat_steps(run_id: uuid.UUID, seq: int, stopped: int, steps: Iterable[int]) -> set[int]:
    """``repeat_effects`` as a set, each a step at or after the fork point."""
    repeat = set()
    for step in steps:
        if isinstance(step, bool) or not isinstance(step, int):
            raise InvalidInput(f"repeat_effects must name steps by their seq, not {step!r}")
        if not seq <= step <= stopped:
            raise InvalidInput(
                f"repeat_effects names step {step}, which is not a step of run {run_id}"
                f" at or after the fork point {seq} (steps {seq} to {stopped})"
            )
        repeat.add(step)
    return repeat


def at_risk(
    using: str,
    run_id: uuid.UUID,
    seq: int,
    journal: list[JournalEntry],
    ledger: list[LedgerEntry],
) -> list[dict[str, Any]]:
    """The steps at or after ``seq`` whose external effect may have happened, in order.

    A step is listed once it was dispatched, whatever came of it: "confirmed"
    (journaled as succeeded), "unknown" (no outcome recorded after its last
    dispatch) or "dispatched" (an outcome the kernel recorded, which a
    provider may still contradict). A children step is listed when one of its
    child runs, at any depth, dispatched one.
    """
    steps: dict[int, dict[str, Any]] = {}
    for entry in ledger:
        if entry.seq is None or entry.seq < seq:
            continue
        if entry.kind == LedgerEntry.Kind.DISPATCHED and entry.effect in _EXTERNAL:
            steps[entry.seq] = {
                "seq": entry.seq,
                "action": entry.action_name,
                "effect": entry.effect,
                "state": "unknown",
            }
        elif entry.seq in steps and entry.kind in CLOSING_KINDS:
            steps[entry.seq]["state"] = "dispatched"
    for journaled in journal[seq:]:
        if journaled.effect in _EXTERNAL and journaled.state == JournalEntry.State.SUCCEEDED:
            at = steps.setdefault(
                journaled.seq,
                {"seq": journaled.seq, "action": journaled.action_name, "effect": journaled.effect},
            )
            at["state"] = "confirmed"
    by_seq = {e.seq: e for e in journal}
    for step, child_ids in db.fetchall(using, CHILD_DISPATCHES_SQL, [run_id, seq]):
        parent_entry = by_seq.get(step)
        steps.setdefault(
            step,
            {
                "seq": step,
                "action": parent_entry.action_name if parent_entry else "children",
                "effect": "children",
                "state": "dispatched",
                "children": list(child_ids),
            },
        )
    return [steps[s] for s in sorted(steps)]


def kept_keys(
    run: WorkflowRun,
    journal: list[JournalEntry],
    ledger: list[LedgerEntry],
    seq: int,
    repeat: set[int],
) -> dict[int, dict[str, str]]:
    """The effect keys the fork's IDEMPOTENT steps keep: ``{seq: {"key", "action"}}``.

    Each IDEMPOTENT step the original journaled at or after the fork point, and
    the step it stopped at (it may have called its provider before it failed,
    or been canceled), keeps the key the original used there (its own, or the
    one it kept from its own original). A step named in ``repeat`` gets a new
    key. ``action`` "" (the stopped step, not journaled): any IDEMPOTENT action.
    """
    inherited = inherited_keys(ledger)
    keys: dict[int, dict[str, str]] = {}
    for step in range(seq, len(journal) + 1):
        if step in repeat:
            continue
        if step < len(journal):
            entry = journal[step]
            if entry.effect != Effect.IDEMPOTENT.value:
                continue
            action = entry.action_name
        else:
            action = run.wait_action if run.wait_step == step else ""
        keys[step] = {"key": key_for(inherited, step, action, f"{run.pk}:{step}"), "action": action}
    return keys


def inherited_keys(ledger: Iterable[LedgerEntry]) -> dict[int, tuple[str, str]]:
    """The effect keys a fork keeps from its original, by step: (key, action), from its
    "forked" ledger entry (chained and anchored: not a column the runtime role
    could change). Empty for a run that is no fork."""
    for entry in ledger:
        detail = entry.detail
        if entry.kind == LedgerEntry.Kind.FORKED and detail and "forked_from" in detail:
            return {int(s): (k["key"], k["action"]) for s, k in detail["keys"].items()}
    return {}


def key_for(inherited: dict[int, tuple[str, str]], seq: int, action: str, own: str) -> str:
    """The effect key of an IDEMPOTENT step ``seq`` of ``action``: the kept one, when
    the original ran that action there (or its action is not known), else ``own``."""
    kept = inherited.get(seq)
    if kept is None or (kept[1] and action and kept[1] != action):
        return own
    return kept[0]
