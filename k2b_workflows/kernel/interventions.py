"""Operators' interventions on a run: cancel it, settle its effect, retry it.

The failure this module is built around: an intervention that writes the
run, its journal and its ledger by hand, beside the kernel that writes them
everywhere else, and misses what the kernel keeps true. A resolution that
re-queued a run without clearing its end seal left a queued run "tampered";
a cancel that ended a subtree but not its children's AI tasks let a provider
answer into a canceled run. Here each intervention is one function of the
kernel, run under the run's lock (``db.lock_run``), appending to the chains
through ``evidence`` and re-queuing through ``REQUEUE_SQL``, the one statement
by which an operator puts a run back in line. ``control`` checks the
arguments and the actor's permission, then calls these.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.db import transaction

from .. import codes, tracing
from ..exceptions import EvidenceChanged, NotRetryable, ResolutionRefused
from ..models import TERMINAL_STATUSES, JournalEntry, LedgerEntry, RunStatus, WorkflowRun
from . import attempts, clock, db, ended, evidence, waits
from .requeue import requeue_set

EFFECT_CONFIRMED = "effect_confirmed"
EFFECT_ABSENT = "effect_absent"
RESOLUTION_DECISIONS = (EFFECT_CONFIRMED, EFFECT_ABSENT)
#: ``EFFECT_CONTRADICTED`` (#47): a holder's late result and the decision that closed its
#: call disagree; the operator settles it with the provider, as any effect in doubt.
RESOLVABLE_CODES = (
    codes.EFFECT_OUTCOME_UNKNOWN,
    codes.WORKFLOW_RETRY_EXHAUSTED,
    codes.EFFECT_CONTRADICTED,
)
#: Incidents an operator ends with "retry": the cause is the code or the stored
#: evidence, so a retry after a fix (a deploy, a patch, restored rows) replays anew.
RETRYABLE_INCIDENT_CODES = (
    codes.WORKFLOW_NONDETERMINISTIC,
    codes.WORKFLOW_CODE_ERROR,
    codes.INTEGRITY_CHAIN_BROKEN,
)

#: Failed runs an operator may retry: a run whose retries ran out (its failures were
#: never journaled, so it replays to the step and calls it again), and a django.tasks
#: call that failed by raising (#51): its failure is journaled, and its task's workflow
#: calls the function once more at the next step for each retry naming that failure
#: (``FAILED_STEP``, read by ``tasks/runs.py``): one more attempt of the same call.
RETRYABLE_FAILURE_CODES = (codes.WORKFLOW_RETRY_EXHAUSTED, codes.TASK_FAILED)
#: The key of a ``RETRIED`` entry's detail that grants a task call one more attempt.
FAILED_STEP = "failed_step"

#: An operator puts a run back in line: due now, its failures forgotten under a new
#: sealed number (``attempts.py``: nothing else may queue a failed run again), its
#: incident and end cleared (a queued run has no end seal to match).
_REQUEUED = requeue_set(
    release=False,
    end_seal="''",
    error_code="''",
    error_message="''",
    error_detail="NULL",
    attention_step="NULL",
    run_after="k2b_now()",
    finished_at="NULL",
    # A failed run that no longer held its unique key does not take it back: a later
    # call's run may hold it, and the index would refuse this retry (kernel/uniques.py).
    unique_key=(
        "CASE WHEN status IN ('failed', 'canceled') AND unique_states NOT IN (4, 5)"
        " THEN NULL ELSE unique_key END"
    ),
    cancel_requested_at="NULL",
    cancel_reason="''",
)
REQUEUE_SQL = f"""
UPDATE k2b_run
   SET {_REQUEUED}, {attempts.SET_ALWAYS}
 WHERE id = %s
"""


def _requeue(using: str, run: WorkflowRun) -> None:
    """Put ``run`` (read under its lock) back in line, as ``REQUEUE_SQL`` says."""
    reset = attempts.next_for(run.pk, run.attempts_seq)
    db.execute(using, REQUEUE_SQL, [*attempts.always_params(reset), run.pk])


#: A run only if it is past its workflow's timeout and still unfinished.
OVERDUE_SQL = """
SELECT 1 FROM k2b_run WHERE id = %s AND timeout_at <= k2b_now()
   AND status IN ('queued', 'running', 'waiting')
"""

#: The run and its whole subtree of children, ended as canceled.
CANCEL_TREE_SQL = """
WITH RECURSIVE tree AS (
    SELECT id FROM k2b_run WHERE id = %s
    UNION ALL
    SELECT r.id FROM k2b_run r JOIN tree t ON r.parent_id = t.id)
UPDATE k2b_run SET status = 'canceled', error_code = %s, error_message = %s,
       finished_at = k2b_now(), updated_at = k2b_now(),
       -- A running holder keeps its lease, and with it its slot, until its
       -- worker has left run() (#35: triggers.SlotRelease).
       lease_expires_at = CASE WHEN status = 'running' AND holds_slot
                               THEN lease_expires_at END
 WHERE id IN (SELECT id FROM tree)
   AND status NOT IN ('succeeded', 'failed', 'canceled')
RETURNING id, workflow_name, generation
"""

#: The end seals of the runs a cancel ended, in one statement.
SEAL_CANCELED_SQL = """
UPDATE k2b_run r SET end_seal = s.seal
  FROM unnest(%s::uuid[], %s::text[]) AS s(id, seal) WHERE r.id = s.id
"""

#: The canceled runs' AI tasks: a provider's late answer is discarded.
CANCEL_AI_TASKS_SQL = """
UPDATE k2b_ai_task SET status = 'canceled', finished_at = k2b_now(),
       updated_at = k2b_now(), lease_expires_at = NULL
 WHERE run_id = ANY(%s) AND status IN ('queued', 'running')
"""


def cancel(
    using: str,
    run_id: uuid.UUID,
    reason: str,
    *,
    code: str = codes.CANCELED,
    overdue: bool = False,
) -> WorkflowRun:
    """Cancel ``run_id`` and its whole subtree, with their AI tasks; an ended run
    is returned unchanged. With ``overdue``, only a run whose ``timeout_at`` has
    passed and that is still queued, running or waiting, checked under its lock
    (the timeout sweep)."""

    def locked() -> WorkflowRun:
        row = db.lock_run(using, run_id)
        if row is None:
            raise WorkflowRun.DoesNotExist(f"no run {run_id}")
        if row[0] in TERMINAL_STATUSES:
            return WorkflowRun.objects.using(using).get(pk=run_id)
        if overdue and not db.fetchall(using, OVERDUE_SQL, [run_id]):
            return WorkflowRun.objects.using(using).get(pk=run_id)
        return _end_canceled(using, run_id, reason, code)

    # A finishing child locks itself, then its parent (to wake it); this locks the
    # parent, then the subtree. When the two deadlock, PostgreSQL aborts one: retry.
    return db.run_in_transaction(locked, using)


def _end_canceled(using: str, run_id: uuid.UUID, reason: str, code: str) -> WorkflowRun:
    """End ``run_id`` (locked, unfinished) and its subtree canceled, with their AI tasks."""
    canceled = db.fetchall(using, CANCEL_TREE_SQL, [run_id, code, reason])
    ids = [r[0] for r in canceled]
    db.execute(
        using,
        SEAL_CANCELED_SQL,
        [ids, [ended.seal(i, "canceled", code, gen) for i, _, gen in canceled]],
    )
    ended.told_each(using, canceled, "canceled", code)
    db.execute(using, CANCEL_AI_TASKS_SQL, [ids])
    evidence.append_ledger(using, run_id=run_id, kind=LedgerEntry.Kind.CANCELED, message=reason)
    run = WorkflowRun.objects.using(using).get(pk=run_id)
    if run.parent_id:
        from .children import wake_parent

        wake_parent(using, run)
    return run


#: A running run asked to stop: marked, not ended. Only its worker ends it now, with
#: what its current step did (``RunEnding.canceled``, ``Execution.stop_if_asked``).
REQUEST_CANCEL_SQL = """
UPDATE k2b_run SET cancel_requested_at = k2b_now(), cancel_reason = %s, updated_at = k2b_now()
 WHERE id = ANY(%s) AND status = 'running' AND cancel_requested_at IS NULL
"""

#: The descendants of a run reached through running runs: a running one is asked with
#: its own children; any other goes with its whole subtree (``CANCEL_TREE_SQL``).
RUNNING_TREE_SQL = """
WITH RECURSIVE tree AS (
    SELECT id, status, true AS descend FROM k2b_run WHERE id = %s
    UNION ALL
    SELECT r.id, r.status, r.status = 'running'
      FROM k2b_run r JOIN tree t ON r.parent_id = t.id WHERE t.descend)
SELECT id, status FROM tree WHERE id <> %s
"""


def request_cancel(using: str, run_id: uuid.UUID, reason: str) -> WorkflowRun:
    """Cancel a run (``tasks.cancel``, ``cancel_workflow_run``): a running one is asked,
    any other unfinished one ends canceled at once with its subtree, as ``cancel``
    ends it; an ended one is returned unchanged.

    Asked, the run's current step goes on and owns the run: its worker hears of it
    at once (a notification) or within a tick of its lease keeper (the fallback),
    and no further step starts: at its next step boundary the run ends canceled,
    its last step's result and effect records committed (``Execution.stop_if_asked``).
    A step that fails, a crash, a retry after it ends it canceled without running
    anything again; a workflow that returns (its last step done) still succeeds, as a
    task call whose function returns normally. An effect in doubt is settled first
    (its reconcile, or an operator), never dropped. Its children are asked alike
    (``ask_children``). Nothing is written to the run's ledger here: its running
    attempt chains its own entries onto the ledger's head, which must not move
    under it; the reason is the run's error message when it ends canceled.
    """

    def locked() -> WorkflowRun:
        row = db.lock_run(using, run_id)
        if row is None:
            raise WorkflowRun.DoesNotExist(f"no run {run_id}")
        if row[0] in TERMINAL_STATUSES:
            return WorkflowRun.objects.using(using).get(pk=run_id)
        if row[0] != RunStatus.RUNNING:
            return _end_canceled(using, run_id, reason, codes.CANCELED)
        _ask(using, [run_id], reason)
        ask_children(using, run_id, reason)
        return WorkflowRun.objects.using(using).get(pk=run_id)

    return db.run_in_transaction(locked, using)


def ask_children(using: str, run_id: uuid.UUID, reason: str | None = None) -> list[uuid.UUID]:
    """Ask the children of ``run_id`` (locked) to stop: a running child is asked, with its
    own children, any other unfinished one ends canceled at once with its subtree, as a
    parked run does. Returns the ids asked. ``reason``: None reads the run's own (its
    worker ends it canceled: the children its current step made go too).

    One index walk when the run has no children, as most runs have none."""
    rows = db.fetchall(using, RUNNING_TREE_SQL, [run_id, run_id])
    if not rows:
        return []
    if reason is None:
        found = db.fetchall(using, "SELECT cancel_reason FROM k2b_run WHERE id = %s", [run_id])
        reason = (found[0][0] if found else "") or codes.CANCELED
    for child_id, status in rows:
        if status not in TERMINAL_STATUSES and status != RunStatus.RUNNING:
            _end_canceled(using, child_id, reason, codes.CANCELED)
    asked = [child_id for child_id, status in rows if status == RunStatus.RUNNING]
    _ask(using, asked, reason)
    return asked


def _ask(using: str, run_ids: list[uuid.UUID], reason: str) -> None:
    """Mark ``run_ids`` (running) asked to stop, and tell their workers on commit."""
    if not run_ids:
        return
    db.execute(using, REQUEST_CANCEL_SQL, [reason, run_ids])
    for run_id in run_ids:
        waits.notify(using, f"{waits.CANCEL_NOTICE}{run_id}")


def resolve(
    using: str,
    run_id: uuid.UUID,
    decision: str,
    *,
    evidence_text: str,
    actor: Any,
    output: Any = None,
    step: int | None = None,
    seen_ledger_id: int | None = None,
) -> WorkflowRun:
    """Settle the effect of the step ``run_id`` waits on (see
    ``control.resolve_effect``, which checks the arguments and the permission).

    Refused (``ResolutionRefused``, ``EvidenceChanged``) unless, under the run's
    lock, the run is ``needs_attention`` on a resolvable code, on ``step`` when
    given, with no ledger entry newer than ``seen_ledger_id`` when given.
    """
    expected_step = step
    with transaction.atomic(using=using):
        row = db.lock_run(using, run_id)
        if row is None:
            raise WorkflowRun.DoesNotExist(f"no run {run_id}")
        run = WorkflowRun.objects.using(using).get(pk=run_id)
        status, _, step = row
        if (
            status != RunStatus.NEEDS_ATTENTION
            or step is None
            or (run.error_code not in RESOLVABLE_CODES)
        ):
            raise ResolutionRefused(
                f"run {run_id} is {status}"
                + (f" ({run.error_code})" if run.error_code else "")
                + ": it is not waiting for a decision on an effect"
            )
        if expected_step is not None and expected_step != step:
            raise ResolutionRefused(
                f"run {run_id} needs a decision on step {step}, not on step {expected_step}"
            )
        if seen_ledger_id is not None:
            head = LedgerEntry.objects.using(using).filter(run_id=run_id).order_by("-id").first()
            if head is not None and head.pk != seen_ledger_id:
                raise EvidenceChanged(
                    f"run {run_id}: new evidence since ledger entry {seen_ledger_id} "
                    f"(entry {head.pk}: {head.kind})",
                    head=head,
                )
        dispatched = (
            LedgerEntry.objects.using(using)
            .filter(run_id=run_id, seq=step, kind=LedgerEntry.Kind.DISPATCHED)
            .order_by("-id")
            .first()
        )
        if dispatched is None:
            raise ResolutionRefused(f"run {run_id} step {step} has no dispatched effect")
        if JournalEntry.objects.using(using).filter(run_id=run_id, seq=step).exists():
            # A contradiction found after the step was journaled (the takeover's
            # answer, or the workflow went on past its failure): nothing to settle
            # in the run any more.
            raise ResolutionRefused(
                f"run {run_id} step {step} is journaled already: settle the effect with "
                "the provider, then cancel the run"
            )
        common = dict(
            run_id=run_id,
            seq=step,
            action_name=dispatched.action_name,
            effect=dispatched.effect,
            invocation_key=dispatched.invocation_key,
            effect_key=dispatched.effect_key,
            generation=run.generation,
            actor=actor.get_username(),
            actor_id=actor.pk,
            evidence=evidence_text,
        )
        if decision == EFFECT_CONFIRMED:
            evidence.append_ledger(
                using,
                kind=LedgerEntry.Kind.RESOLVED_CONFIRMED,
                output_hash=evidence.hash_value(output),
                **common,
            )
            last = JournalEntry.objects.using(using).filter(run_id=run_id).order_by("-seq").first()
            entry = JournalEntry(
                run_id=run_id,
                seq=step,
                action_name=dispatched.action_name,
                effect=dispatched.effect,
                state=JournalEntry.State.SUCCEEDED,
                output=output,
                summary=f"confirmed by {actor.get_username()}",
                input_hash=dispatched.input_hash,
                generation=run.generation,
                created_at=clock.now(),
            )
            evidence.append_journal(entry, last.entry_hash if last else evidence.GENESIS, using)
        else:
            evidence.append_ledger(using, kind=LedgerEntry.Kind.RESOLVED_ABSENT, **common)
        _requeue(using, run)
    if tracing.ENABLED:
        tracing.decided(run, decision, step)
    return WorkflowRun.objects.using(using).get(pk=run_id)


def retry_refusal(run: WorkflowRun) -> str:
    """Why "retry" does not apply to ``run`` ("" when it does)."""
    if run.status == RunStatus.NEEDS_ATTENTION:
        if run.error_code in RETRYABLE_INCIDENT_CODES:
            return ""
        return f"needs attention with {run.error_code or 'no code'}: decide on the effect instead"
    if run.status != RunStatus.FAILED:
        return f"{run.status}, not failed"
    if run.error_code not in RETRYABLE_FAILURE_CODES:
        return (
            f"failed with {run.error_code}, a journaled outcome that a retry would replay;"
            " only runs that exhausted their retries, and task calls that failed, can be"
            " retried"
        )
    return ""


def retry_detail(run: WorkflowRun) -> dict[str, int] | None:
    """What a retry's ledger entry records beside its reason: for a task call that
    failed by raising, the step whose failure the retry answers (``FAILED_STEP``)."""
    if run.error_code == codes.TASK_FAILED:
        return {FAILED_STEP: max(run.journal_length - 1, 0)}
    return None


def retry(using: str, run_id: uuid.UUID, *, actor: Any, reason: str) -> WorkflowRun:
    """Put a run that exhausted its retries, or a code incident, back in line
    (see ``control.retry_workflow_run``); ``NotRetryable`` otherwise, checked
    under the run's lock."""
    with transaction.atomic(using=using):
        row = db.lock_run(using, run_id)
        if row is None:
            raise WorkflowRun.DoesNotExist(f"no run {run_id}")
        run = WorkflowRun.objects.using(using).get(pk=run_id)
        refusal = retry_refusal(run)
        if refusal:
            raise NotRetryable(f"run {run_id} is {refusal}")
        evidence.append_ledger(
            using,
            run_id=run_id,
            kind=LedgerEntry.Kind.RETRIED,
            message=f"{reason} (was {run.error_code})" if run.error_code else reason,
            actor=actor.get_username(),
            actor_id=actor.pk,
            generation=run.generation,
            detail=retry_detail(run),
        )
        _requeue(using, run)
    if tracing.ENABLED:
        tracing.decided(run, "retry", run.attention_step)
    return WorkflowRun.objects.using(using).get(pk=run_id)
