"""One path per effect class: what a new step does before, during and after ``run()``.

What happens after a crash in a step of each class is said in the index of
``kernel/execute.py``; the paths here are where it is made so:

- ``PureOrIdempotent``: nothing is written before ``run()`` but an IDEMPOTENT
  step's charge; the success is deferred to the run's next write.
- ``Transactional``: ``run()`` executes inside the atomic block (``ctx.tx``)
  whose last statement fences the run and journals the step, then commits.
- ``External`` (EXTERNAL, IRREVERSIBLE, SNAPSHOT_RESTORE): a "dispatched"
  ledger entry commits before ``run()``; any doubt after it goes to
  ``reconcile()``, else to an operator, never to a blind re-run.

Each path writes through the run's journal (``journal.RunJournal``) and ends
the claim through ``ending.RunEnding``.
"""

from __future__ import annotations

import abc
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, NoReturn

from django.core.exceptions import PermissionDenied
from django.db import DatabaseError, connections

from .. import codes, settings, validation
from ..actions import (
    Action,
    Ambiguous,
    Effect,
    Failed,
    InvalidResult,
    Succeeded,
    Unknown,
    Waiting,
    validate_result,
)
from ..exceptions import InvalidInput, LeaseLost, RunCanceled, StepFailed, Suspend
from ..limits import RateLimit
from ..models import JournalEntry, LedgerEntry
from . import (
    budgets,
    claim,
    contradictions,
    db,
    events,
    evidence,
    flow,
    holders,
    hooks,
    retrying,
    weather,
    witness,
)
from .ending import Outcome, RunEnding
from .journal import Batch, Claim, EffectState, RunJournal, Step

logger = logging.getLogger(__name__)

#: A TRANSACTIONAL step's block is tried this many times on a serialization conflict.
TRANSACTIONAL_ATTEMPTS = 3


class _Rollback(Exception):
    """Leave a TRANSACTIONAL step's atomic block without committing, carrying the result."""

    def __init__(self, result: Any) -> None:
        self.result = result


@dataclass
class _Denied:
    failed: Failed


def timeout_s(action: Action) -> float:
    """The action's timeout in seconds, as the lease keeper counts it."""
    return action.timeout if action.timeout is not None else settings.action_timeout_ms() / 1000


class EffectPath(abc.ABC):
    """What every path shares: calling a hook under the lease, asking ``authorize()``,
    and applying a result that is not an external one. Each effect class's path is a
    subclass that says what its new step does (``run``)."""

    def __init__(self, claim: Claim, journal: RunJournal, ending: RunEnding) -> None:
        self.claim = claim
        self.journal = journal
        self.ending = ending
        self.using = claim.using
        self.run_id = claim.run_id

    @abc.abstractmethod
    def run(self, step: Step) -> Any:
        """Execute a new step of this path's effect class; its output, or the claim ends."""

    def admit(self, step: Step, limit: RateLimit) -> None:
        """Count this dispatch against the action's rate limit, or defer the run (``flow.py``).

        Its own commit, before the budget charge and the effect: a crash after
        it counts a dispatch that may have happened, never one too few. A full
        window re-queues the run for the instant it frees: no failure counted,
        the thread freed, nothing charged yet.
        """
        try:
            key = flow.limit_key(step.action, step.input)
        except InvalidInput as exc:
            self.ending.fail(codes.INVALID_RATE_LIMIT_KEY, f"step {step.seq} ({step.name}): {exc}")
        self.journal.flush_pending()
        generation = self.claim.generation

        def admit() -> tuple[int | None, Any]:
            self.journal.fence(step.seq)
            reserved, until = flow.admit_dispatch(
                self.using, key, limit, self.run_id, step.seq, generation
            )
            if until is not None:
                flow.defer(
                    self.using, self.run_id, generation, until, key, step.action.action_name()
                )
            return reserved, until

        reserved, until = db.run_in_transaction(admit, self.using)
        if until is None:
            step.rate_dispatch = reserved
            return
        self.ending.ended(Outcome.DEFERRED, step=step.seq, reason=f"rate limit of {key} full")

    def call(self, step: Step, hook: str, allowed: tuple[type, ...]) -> Any:
        """Call an action hook with the lease kept alive, and validate what it returns."""
        keeper = self.claim.keeper
        if keeper:
            external = hook == "run" and step.action.effect.is_external
            keeper.action_started(self.run_id, step.action.timeout, external=external)
        if hook == "run" and step.rate_dispatch is not None:
            flow.stamp_dispatch(self.using, step.rate_dispatch)
            step.rate_dispatch = None
        try:
            result = hooks.call(
                getattr(step.action, hook), step.ctx, step.input, timeout_s(step.action)
            )
        except StepFailed as exc:
            if step.action.effect.is_external:
                raise  # after dispatch nothing proves the effect absent: outcome unknown
            # A kernel service the hook used (create_child_workflow_runs) refused before
            # any effect: the step fails with that code, journaled like any other failure.
            result = Failed(exc.message, exc.code)
        except Exception as exc:
            result = self._not_retried(step, hook, exc)
            if result is None:
                raise
        finally:
            if keeper:
                keeper.action_finished(self.run_id)
        return validate_result(result, allowed, hook)

    def _not_retried(self, step: Step, hook: str, exc: Exception) -> Failed | None:
        """An exception ``run()`` raised that its policy's ``Retry(on=...)`` does not name:
        the step fails at once, not retried. None: it goes on as any exception does
        (a retry, or an unknown outcome after a dispatch).

        Only ``run()`` of an action whose effect cannot have happened unseen: after an
        external dispatch an exception is an unknown outcome whatever its class. The
        kernel's own exceptions (a lost lease, a cancel, the database) are never
        the action's failure.
        """
        policy = self.claim.retry_policy
        if hook != "run" or policy is None or not policy.on or step.action.effect.is_external:
            return None
        if isinstance(exc, _KERNEL_ERRORS):
            return None
        if weather.is_connection_error(exc) or policy.retries_exception(exc):
            return None
        return Failed(
            f"{type(exc).__name__}: {exc} (not retried: Retry(on=...) does not name it)",
            codes.ACTION_FAILED,
        )

    def authorize(self, step: Step) -> Failed | None:
        """Ask the action just before its effect. A denial is a ``Failed``; a result that
        is not None, succeeded or failed raises ``InvalidResult``; other errors propagate."""
        if not step.action.defines("authorize"):
            return None
        try:
            result = hooks.call(step.action.authorize, step.ctx, step.input, timeout_s(step.action))
        except PermissionDenied as exc:
            return Failed(str(exc) or "permission denied", codes.FORBIDDEN)
        if result is None or isinstance(result, Succeeded):
            return None
        if isinstance(result, Failed):
            return Failed(result.message, result.code or codes.FORBIDDEN)
        raise InvalidResult(f"authorize() returned {result!r}")

    def authorize_outside_tx(self, step: Step) -> Failed | None:
        """``authorize()`` before any transaction of the step: its errors end the claim."""
        try:
            return self.authorize(step)
        except InvalidResult as exc:
            self.ending.fail(
                codes.INVALID_ACTION_RESULT, f"step {step.seq} ({step.name}): {exc}", step=step
            )
        except (LeaseLost, RunCanceled, Suspend):
            raise
        except Exception as exc:
            if weather.is_connection_error(exc):
                raise
            self.ending.retry_later(f"step {step.seq} ({step.name}): authorize() raised {exc!r}")

    def denied(self, step: Step, denial: Failed) -> NoReturn:
        """``authorize()`` refused: the step fails, nothing spent."""
        self.journal.step_failed(step, denial.code or codes.FORBIDDEN, denial.message)

    def apply(self, step: Step, result: Succeeded | Failed | Waiting) -> Any:
        """A step's own answer: journal its success, park on its wait, retry or fail it."""
        if isinstance(result, Succeeded):
            return self.journal.journal_success(step, result)
        if isinstance(result, Waiting):
            self.ending.park(step.seq, step.name, result.dependency)
        if result.retryable and retrying.retries(self.claim.retry_policy, result.code):
            self.ending.retry_later(
                f"step {step.seq} ({step.name}) failed: {result.message}", result.delay_ms
            )
        self.journal.step_failed(step, result.code or codes.ACTION_FAILED, result.message)


class PureOrIdempotent(EffectPath):
    """PURE: nothing happens before ``run()``; an exception is a retryable failure.
    IDEMPOTENT: the cost is charged and committed first; after an exception or a
    crash the step runs again with the same ``effect_key``."""

    def run(self, step: Step) -> Any:
        idempotent = step.action.effect == Effect.IDEMPOTENT
        denial = self.authorize_outside_tx(step)
        if denial is not None:
            self.denied(step, denial)
        # After authorize, as for EXTERNAL: a refused step spends nothing.
        if idempotent and step.cost:
            self._charge_before_run(step)
        allowed: tuple[type, ...] = (
            (Succeeded, Failed, Waiting, Ambiguous) if idempotent else (Succeeded, Failed, Waiting)
        )
        try:
            result = self.call(step, "run", allowed)
        except InvalidResult as exc:
            if idempotent:  # repeating with the same effect_key is safe
                self.ending.retry_later(f"step {step.seq} ({step.name}): {exc}")
            self.ending.fail(
                codes.INVALID_ACTION_RESULT, f"step {step.seq} ({step.name}): {exc}", step=step
            )
        if isinstance(result, Ambiguous):
            self.ending.retry_later(
                f"step {step.seq} ({step.name}) ambiguous: {result.message or ''}"
            )
        if isinstance(result, Succeeded) and not idempotent and step.cost:
            # PURE steps have no effect to protect: charge with the journal entry.
            return self.journal.journal_success(step, result, charge=True)
        return self.apply(step, result)

    def _charge_before_run(self, step: Step) -> None:
        def charge() -> None:
            self.journal.fence(step.seq)
            self.journal.charge(step)

        try:
            db.run_in_transaction(charge, self.using)
        except budgets.BudgetExceeded as exc:
            self.journal.step_failed(step, exc.code, str(exc))


class Transactional(EffectPath):
    """``run()`` executes inside the atomic block (``ctx.tx``) that journals the step;
    an exception or a crash rolls both back, and the journal tells on replay
    whether it committed.

    The block's last statement fences the run and journals the step, and COMMIT
    goes with it: a worker whose lease was taken over meanwhile has its
    statement refused and the block rolled back, the action's writes with it.
    The run row's lock is taken after the action's own writes, the order of web
    code that locks its domain rows and then cancels or wakes a run.
    """

    def run(self, step: Step) -> Any:
        attempt = 0
        while True:
            attempt += 1
            try:
                return self._once(step)
            except _Rollback as rb:
                result = rb.result
                if isinstance(result, InvalidResult):
                    self.ending.fail(
                        codes.INVALID_ACTION_RESULT,
                        f"step {step.seq} ({step.name}): {result}",
                        step=step,
                    )
                if isinstance(result, budgets.BudgetExceeded):
                    self.journal.step_failed(step, result.code, str(result))
                if isinstance(result, _Denied):
                    self.denied(step, result.failed)
                return self.apply(step, result)
            except (LeaseLost, RunCanceled, db.CommitOutcomeUnknown, Suspend):
                raise
            except DatabaseError as exc:
                if weather.is_connection_error(exc):
                    raise
                if db.is_conflict(exc) and attempt < TRANSACTIONAL_ATTEMPTS:
                    logger.info("run %s step %s: conflict, retrying", self.run_id, step.seq)
                    continue
                self.ending.retry_later(f"step {step.seq} ({step.name}): database error: {exc}")
            except Exception as exc:
                self.ending.retry_later(
                    f"step {step.seq} ({step.name}) raised {type(exc).__name__}: {exc}"
                )

    def _once(self, step: Step) -> Any:
        try:
            return self._block(step)
        except db.BatchRefused:
            # The journal write found the run not ours: the block rolled back.
            raise db.lease_lost(self.using, self.run_id, self.claim.generation) from None

    def _block(self, step: Step) -> Any:
        journal = self.journal
        pending = journal.pending
        prev = journal.last_hash
        with db.atomic(self.using) as block, db.holding_run_lock():
            step.ctx.tx = block
            # No fence yet: the statement that journals the step fences the run, and
            # nothing of the block commits unless it passes.
            if pending is not None:
                # The previous step's deferred success (PURE or IDEMPOTENT: no ledger
                # entry, see ``carries_pending``), with the PURE successes riding with
                # it, in a statement that fences: it commits with this step, or rolls
                # back with it and stays deferred.
                evidence.append_journal_fenced(
                    pending.entries,
                    prev,
                    self.using,
                    lease_ms=settings.lease_ms(),
                    reset=journal.reset,
                )
                prev = pending.entry.entry_hash
            if step.cost:
                try:
                    journal.charge(step)
                except budgets.BudgetExceeded as exc:
                    raise _Rollback(exc) from None
            try:
                denial = self.authorize(step)
                if denial is not None:
                    raise _Rollback(_Denied(denial))
                result = self.call(step, "run", (Succeeded, Failed, Waiting))
            except InvalidResult as exc:
                raise _Rollback(exc) from None
            if not isinstance(result, Succeeded):
                raise _Rollback(result)
            # The fence, extending the lease, in the statement that journals the step,
            # and COMMIT with it: a takeover while the action ran refuses it here.
            entry = journal.new_entry(step, JournalEntry.State.SUCCEEDED, result)
            if db.ends_in_atomic(self.using):
                sql, params = evidence.fenced_journal_statement(
                    entry, prev, lease_ms=settings.lease_ms(), reset=journal.reset, strict=True
                )
                row = db.commit_in_atomic(self.using, sql, params)
                evidence.fenced_journal_written(entry, self.using, row)
            else:
                evidence.append_journal_fenced(
                    entry, prev, self.using, lease_ms=settings.lease_ms(), reset=journal.reset
                )
        step.ctx.tx = None
        journal.pending_committed(pending)
        journal.journaled(entry)
        return validation.copy_json(entry.output)


class External(EffectPath):
    """EXTERNAL, IRREVERSIBLE, SNAPSHOT_RESTORE: a "dispatched" ledger entry with the
    evidence hashes commits before ``run()``; after an exception, a crash, an
    invalid or late result the outcome is unknown: never re-run blindly, but
    ``reconcile()``, else an operator decides."""

    def run(self, step: Step) -> Any:
        """A new external step. The previous step's deferred success, if any, is not
        flushed yet (see ``Execution.step``): it commits in the dispatch's transaction,
        before the provider is called; every other way out of here flushes it first."""
        journal = self.journal
        state = journal.effects.setdefault(step.seq, EffectState())
        if state.open_key:
            # Dispatched before (a crash, an exception, a late result): never run
            # it again blindly. Ask the provider, or an operator; not while the
            # worker that called it may still be inside the call.
            journal.flush_pending()
            step.ctx.invocation_key = state.open_key
            self.wait_for_holder(step)
            return self.reconcile(step, state)
        denial = self.authorize_outside_tx(step)
        if denial is not None:
            journal.flush_pending()
            journal.ledger_event(
                step, LedgerEntry.Kind.REJECTED, message=denial.message, fenced=True
            )
            self.denied(step, denial)
        invocation_key = f"{step.ctx.effect_key}:{state.attempts + 1}"
        step.ctx.invocation_key = invocation_key
        keeper = self.claim.keeper
        with keeper.calling(self.run_id) if keeper else contextlib.nullcontext():
            result = self._dispatch_and_call(step, invocation_key)
        if isinstance(result, Ambiguous):
            journal.ledger_event(
                step, LedgerEntry.Kind.OUTCOME_UNKNOWN, message=result.message or "", fenced=True
            )
            return self.reconcile(step, state)
        if isinstance(result, Succeeded):
            return journal.journal_success(step, result, ledger_kind=LedgerEntry.Kind.SUCCEEDED)
        self._failed(step, result, LedgerEntry.Kind.FAILED)

    def _dispatch_and_call(self, step: Step, invocation_key: str) -> Any:
        """Commit the dispatch, then call ``run()``: the span of the keeper's call lock.

        Returns what ``run()`` returned, or an ``Ambiguous`` for whatever it did
        instead of answering (raised, returned something invalid)."""
        journal = self.journal
        pending = journal.pending
        state = journal.effects[step.seq]

        def dispatch() -> None:
            journal.fence(step.seq, reset_failures=pending is not None)
            if pending is not None:
                journal.write_pending(pending)
            if step.cost:
                journal.charge(step)
            journal.ledger(step, LedgerEntry.Kind.DISPATCHED, with_hashes=True)

        def dispatch_batched() -> bool:
            if step.cost or not db.batches_statements(self.using):
                return False
            batch = Batch(journal, step.seq, reset_failures=pending is not None)
            if pending is not None:
                batch.pending(pending)
            batch.ledger(step, LedgerEntry.Kind.DISPATCHED, with_hashes=True)
            return batch.commit()

        try:
            if not dispatch_batched():
                db.run_in_transaction(dispatch, self.using)
        except budgets.BudgetExceeded as exc:
            journal.flush_pending()  # rolled back with the dispatch: written now, alone
            journal.ledger_event(step, LedgerEntry.Kind.REJECTED, message=str(exc), fenced=True)
            journal.step_failed(step, exc.code, str(exc))
        except (LeaseLost, RunCanceled):
            journal.pending_lost(pending)
            raise
        except db.CommitOutcomeUnknown:
            self._close_unsent_dispatch(step, invocation_key)
            raise
        journal.pending_committed(pending)
        state.attempts += 1
        state.open_key = invocation_key
        # Told outside the database before the provider is: a database restored to a
        # moment before this commit no longer holds it, and the witness says so.
        witness.dispatched(self.run_id, step.seq, self.claim.generation, *journal.ledger_end())

        try:
            result = self.call(step, "run", (Succeeded, Failed, Ambiguous))
        except (LeaseLost, RunCanceled) as exc:
            journal.late_evidence(step, f"run() stopped: {exc}")
            raise
        except InvalidResult as exc:
            result = Ambiguous(f"invalid result after dispatch: {exc}")
        except Suspend:
            raise
        except Exception as exc:
            result = Ambiguous(f"run() raised after dispatch: {type(exc).__name__}: {exc}")
        return result

    def wait_for_holder(self, step: Step) -> None:
        """Queue the run again for a lease later if the worker that dispatched the open
        call may still be inside it (present, no answer of its own yet): no failure
        counted, nothing asked (#47).

        The reaper leaves such a run to its holder; but a run taken by other means (a
        reaper of an older release, the runtime role setting it back to ``queued``)
        reaches this replay while the call is in flight, and a ``reconcile()`` asked
        now hears "absent" from a provider that has not seen it yet. Once the holder
        has answered (its late result) or is gone, the run is reconciled as after any
        crash.
        """
        holder = holders.still_in_call(
            self.using, self.run_id, step.seq, step.ctx.invocation_key or ""
        )
        if holder is None:
            return

        def defer() -> None:
            self.journal.fence(step.seq)
            claim.release(self.using, self.run_id, self.claim.generation, settings.lease_ms())

        db.run_in_transaction(defer, self.using)
        self.ending.ended(
            Outcome.DEFERRED,
            step=step.seq,
            reason=f"worker {holder} may still be inside the call",
        )

    def _close_unsent_dispatch(self, step: Step, invocation_key: str) -> None:
        """The dispatch's COMMIT lost its answer: it may have committed, but run() was not called.

        This process knows what no replay could: if the dispatch is in the ledger,
        close that invocation as never sent, so the replay dispatches anew instead
        of treating it as doubted. Without our lease nothing is written, and the
        replay reconciles as after any crash.
        """
        connections[self.using].close()

        def close() -> None:
            self.journal.fence(step.seq)
            if (
                LedgerEntry.objects.using(self.using)
                .filter(
                    run_id=self.run_id,
                    invocation_key=invocation_key,
                    kind=LedgerEntry.Kind.DISPATCHED,
                )
                .exists()
            ):
                self.journal.ledger(
                    step,
                    LedgerEntry.Kind.REJECTED,
                    message="the dispatch's commit lost its answer; run() was not called",
                )

        try:
            db.run_in_transaction(close, self.using)
        except (DatabaseError, LeaseLost, RunCanceled, db.CommitOutcomeUnknown) as exc:
            logger.warning(
                "run %s step %s: could not close the unsent dispatch: %s",
                self.run_id,
                step.seq,
                exc,
            )

    def reconcile(self, step: Step, state: EffectState) -> Any:
        """Ask the provider what became of a dispatched effect; doubt goes to an operator."""
        journal, ending = self.journal, self.ending
        if not step.action.defines("reconcile"):
            journal.ledger_event(
                step,
                LedgerEntry.Kind.RECONCILE_UNKNOWN,
                message="the action has no reconcile()",
                fenced=True,
            )
            ending.needs_attention(
                codes.EFFECT_OUTCOME_UNKNOWN,
                f"step {step.seq} ({step.name}): outcome unknown and no reconcile()",
                step=step.seq,
            )
        try:
            result = self.call(step, "reconcile", (Succeeded, Failed, Unknown, Waiting))
        except (LeaseLost, RunCanceled, Suspend):
            raise
        except InvalidResult as exc:
            result = Unknown(f"reconcile() returned an invalid result: {exc}")
        except Exception as exc:
            if weather.is_connection_error(exc):
                raise  # a lookup that could not reach our database tells nothing: ask again later
            result = Unknown(f"reconcile() raised {type(exc).__name__}: {exc}")
        events.reconcile_answered(
            self.claim, step.seq, step.ctx.effect_key, type(result).__name__.lower()
        )
        if isinstance(result, (Succeeded, Failed)):
            self._against_the_late_answer(step, result)
        if isinstance(result, Succeeded):
            return journal.journal_success(step, result, ledger_kind=LedgerEntry.Kind.RECONCILED)
        if isinstance(result, Waiting) and state.polls >= settings.max_reconcile_polls():
            # A provider that stays "pending" would be polled forever, a ledger
            # row and a generation each time: past the bound, an operator decides.
            result = Unknown(f"still pending after {state.polls} polls (MAX_RECONCILE_POLLS)")
        if isinstance(result, Waiting):
            # Still pending at the provider: poll again on a wake or at the deadline,
            # each poll a new ledger operation under the same effect key.
            dep = result.dependency
            ending.park(
                step.seq,
                step.name,
                dep,
                pending=(step, f"pending: waiting on {dep.kind}/{dep.key}"),
            )
        if isinstance(result, Failed):
            # The provider says it did not happen. A lookup can lag behind the
            # provider's own writes, so that alone never re-runs the step: only an
            # operator's "effect absent" does, or an action whose provider
            # deduplicates by the effect key, where a second dispatch under the same
            # key cannot charge twice (#38).
            self._failed(
                step,
                result,
                LedgerEntry.Kind.RECONCILED,
                may_retry=step.action.redispatch_when_absent,
            )
        journal.ledger_event(
            step, LedgerEntry.Kind.RECONCILE_UNKNOWN, message=result.message or "", fenced=True
        )
        ending.needs_attention(
            codes.EFFECT_OUTCOME_UNKNOWN,
            f"step {step.seq} ({step.name}): reconcile() cannot tell: {result.message or ''}",
            step=step.seq,
        )

    def _against_the_late_answer(self, step: Step, result: Succeeded | Failed) -> None:
        """``reconcile()`` says the opposite of what the call answered its own worker, late
        (a lookup that lags behind the provider's writes): an incident, never a silent
        end either way (#47). The answer is recorded naming the late result, the
        invocation stays open, and an operator settles it."""
        said = contradictions.SUCCEEDED if isinstance(result, Succeeded) else contradictions.FAILED
        late = contradictions.late_answer(
            self.using, self.run_id, step.seq, step.ctx.invocation_key or "", said
        )
        if late is None:
            return
        journal = self.journal
        kind = LedgerEntry.Kind.RECONCILE_UNKNOWN
        message = f"reconcile() said {said}; the call itself answered {late['outcome']}, late"

        def record() -> LedgerEntry:
            journal.fence(step.seq)
            values = journal.ledger_values(
                step, kind, message=message, detail={"outcome": said, "contradicts": late}
            )
            entry = evidence.append_ledger(self.using, expect=journal.ledger_head, **values)
            journal.ledger_written(step, kind)
            return entry

        entry = db.run_in_transaction(record, self.using)
        self.ending.needs_attention(
            codes.EFFECT_CONTRADICTED,
            f"step {step.seq} ({step.name}): {message} (ledger entries {entry.pk} and "
            f"{late['entry']})",
            step=step.seq,
            detail={
                "kind": "contradiction",
                "seq": step.seq,
                "late_result": late["entry"],
                "entry": entry.pk,
                "outcome": said,
            },
        )

    def _failed(self, step: Step, result: Failed, kind: str, *, may_retry: bool = True) -> NoReturn:
        """The provider says the effect did not happen.

        A retryable failure answered by ``run()`` itself is a clean answer: the
        step runs again later under a new invocation key and the same effect key.
        After doubt (``may_retry=False``: ``reconcile()`` of an action without
        ``redispatch_when_absent``) the step fails instead.
        """
        journal = self.journal
        state = journal.effects[step.seq]

        def record() -> None:
            journal.fence(step.seq)
            journal.ledger(
                step,
                kind,
                message=result.message,
                detail={"outcome": "failed", "code": result.code, "retryable": result.retryable},
            )

        try:
            db.run_in_transaction(record, self.using)
        except (LeaseLost, RunCanceled):
            journal.late_evidence(
                step,
                f"failed result after losing the run: {result.message}",
                outcome=contradictions.FAILED,
            )
            raise
        state.open_key = None
        if (
            result.retryable
            and may_retry
            and retrying.retries(self.claim.retry_policy, result.code)
        ):
            self.ending.retry_later(
                f"step {step.seq} ({step.name}) failed: {result.message}", result.delay_ms
            )
        journal.step_failed(step, result.code or codes.ACTION_FAILED, result.message)


#: Raised through an action's hook by the kernel itself, never the action's own failure.
_KERNEL_ERRORS = (LeaseLost, RunCanceled, Suspend, DatabaseError, db.CommitOutcomeUnknown)


def path_for(effect: Effect) -> type[EffectPath]:
    """The path of a new step of this effect class."""
    if effect.is_external:
        return External
    if effect == Effect.TRANSACTIONAL:
        return Transactional
    return PureOrIdempotent
