"""Executing a claimed run: replay the journal, then run new steps per effect class.

One file answers "what happens after a crash in a step of class X":

- PURE: nothing happens before ``run()``; an exception is a retryable failure.
- TRANSACTIONAL: ``run()`` executes inside the atomic block (``ctx.tx``) whose
  last statement fences the run row and journals the step, then commits; a
  takeover, an exception or a crash rolls both back, and the journal tells on
  replay whether it committed.
- IDEMPOTENT: the cost is charged and committed first; after an exception or a
  crash the step runs again with the same ``effect_key``.
- EXTERNAL, IRREVERSIBLE, SNAPSHOT_RESTORE: a "dispatched" ledger entry with
  the evidence hashes commits before ``run()``; after an exception, a crash, an
  invalid or late result the outcome is unknown: never re-run blindly, but
  ``reconcile()``, else an operator decides.

Every write that advances the run happens in a transaction that first fences
it (``db.fence``): a worker whose lease was taken over can compute but never
commit. Control leaves workflow code through ``Suspend`` (a BaseException) so
that a workflow's ``except Exception`` cannot swallow a park or a lost lease.

Code changes: a run replays on the code of its own (name, version); a replay
that asks for another step than the journal holds stops the run at once
(``WORKFLOW_NONDETERMINISTIC``, with both sides as hashes) before any effect;
an exception from the workflow function itself is a bug, not weather, so the
run waits for an operator (``WORKFLOW_CODE_ERROR``) instead of retrying.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

from django.db import DatabaseError, transaction

from .. import codes, settings, tracing, validation
from ..actions import Action, Effect, Succeeded, as_action, missing_ref
from ..exceptions import InvalidInput, LeaseLost, RunCanceled, StepFailed, Suspend, UnknownWorkflow
from ..models import JournalEntry, WorkflowRun
from ..validation import to_json_value
from ..workflows import (
    RunHandle,
    WorkflowDefinition,
    get_workflow,
    registered_workflows,
)
from . import (
    budgets,
    clock,
    db,
    divergence,
    effects,
    events,
    evidence,
    fanout,
    flow,
    forks,
    patches,
    progress,
    retrying,
    seals,
    timers,
    weather,
)
from .claim import release
from .context import KernelStepContext
from .ending import Outcome, RunEnding
from .journal import RunJournal, Step
from .load import Preloaded, preload

if TYPE_CHECKING:
    from ..retries import Retry
    from .leases import LeaseKeeper
    from .together import EndsTogether

logger = logging.getLogger(__name__)

#: A step that ran this long (seconds) or longer is followed by one read of whether a
#: cancel was asked (#49): against it, one query is nothing, and a request that came
#: while it ran stops the next step even before the lease keeper has told us.
READ_ASKED_AFTER_S = 0.05

_ASKED_SQL = "SELECT cancel_requested_at IS NOT NULL FROM k2b_run WHERE id = %s"


class StepCall(NamedTuple):
    """A new step as the workflow asked for it (``run.step``), before it runs: what
    ``_executed`` and ``_new_step`` pass on (the journal's ``Step`` is made from it)."""

    seq: int
    action: Action
    name: str
    input: Any
    input_hash: str
    approval_ref: str | None
    backup_ref: str | None


class Execution:
    """One claim of one run: replays it and executes steps until it stops, parks or ends."""

    def __init__(
        self,
        run_id: uuid.UUID,
        generation: int,
        *,
        using: str | None = None,
        keeper: LeaseKeeper | None = None,
        preloaded: Preloaded | None = None,
    ) -> None:
        self.run_id = run_id
        self.generation = generation
        self.using = using or settings.database()
        self.keeper = keeper
        self.canceled = threading.Event()
        self.cancel_requested = threading.Event()
        self.next_seq = 0
        self.steps_executed = 0
        #: How this claim ended (an ``Outcome``).
        self.outcome: str = Outcome.DROPPED
        #: Set by a worker shutting down: stop before the next step and release the run.
        self.stop_requested: threading.Event | None = None
        #: Set by a worker thread that commits pure runs' ends together (``together.py``).
        self.together: EndsTogether | None = None
        #: The run's row, journal and ledger, read in the claim's transaction.
        self.preloaded = preloaded
        #: The run could not be released after a lost connection: the worker must.
        self.release_pending = False
        #: This claim's ``k2b.run`` span (``tracing.py``); None when nothing traces.
        self.trace: tracing.RunTrace | None = None
        #: The retry policy of the step being executed (``retries.Retry``), if any.
        self.retry_policy: Retry | None = None
        # Set once the claim is loaded (``execute``):
        #: The run's row as claimed.
        self.run: WorkflowRun
        self.root_id: uuid.UUID
        self.app_id: str
        #: A copy of the run's principal: what a step's ``ctx`` sees.
        self.principal: Any
        self.definition: WorkflowDefinition
        #: The run's journal and ledger, and every write to them.
        self.journal: RunJournal
        #: How this claim ends the run.
        self.ending: RunEnding
        #: The path of each effect class, made at the first step of that class.
        self._paths: dict[type[effects.EffectPath], effects.EffectPath] = {}
        #: A fork's IDEMPOTENT steps' effect keys kept from its original (``forks.py``).
        self.inherited_keys: dict[int, tuple[str, str]] = {}
        #: When the last new step's action began (``time.monotonic``), until the next
        #: step boundary looked at it (``_asked_now``).
        self._step_began: float | None = None

    # -- entry point ---------------------------------------------------------

    def execute(self) -> str:
        """Run until the workflow ends, parks, retries later or loses its lease.

        Returns the outcome, a short label for the worker's statistics.
        """
        loaded = self.preloaded
        if loaded is None:
            # One read-only transaction for the run, its journal and its ledger.
            with transaction.atomic(using=self.using):
                loaded = preload(self.using, [self.run_id]).get(self.run_id)
        if (
            loaded is None
            or loaded.run.generation != self.generation
            or (loaded.run.status != "running")
        ):
            return self.outcome
        run = loaded.run
        self.run = run
        self.root_id = run.root_id or run.id
        self.app_id = run.app_id
        self.principal = validation.copy_json(run.principal)
        self.journal = RunJournal(self, loaded)
        self.ending = RunEnding(self, self.journal)
        if run.forked_from_id is not None:
            self.inherited_keys = forks.inherited_keys(loaded.ledger)
        events.run_claimed(self)
        if self.keeper:
            self.keeper.track(
                self.run_id, self.generation, self.canceled, asked=self.cancel_requested
            )
        if tracing.ENABLED:
            self.trace = tracing.run_started(self)
        try:
            # Before anything replays the journal or trusts the ledger: a tampered,
            # truncated or wiped chain stops the run here, with nothing executed.
            self._verify_loaded(loaded)
            if run.cancel_requested_at is not None:
                # Asked to stop before this claim (a crash, a retry queued as the cancel
                # committed): no further attempt of a canceled call, no further step of
                # a canceled run starts (#49). An external effect in doubt is settled
                # first, as after any crash (its reconcile, or an operator): only a
                # retry, or a new step, is refused (``RunEnding``, ``stop_if_asked``).
                self.cancel_requested.set()
                if not self.journal.open_steps():
                    self.ending.canceled("canceled before this attempt")
            try:
                self.definition = get_workflow(run.workflow_name, run.workflow_version)
            except UnknownWorkflow as exc:
                if _has_other_versions(run.workflow_name):
                    # Another process may hold this version's code (a rolling deploy):
                    # hand the run back rather than fail or replay it on other code.
                    logger.warning("run %s: %s; released", self.run_id, exc)
                    release(self.using, self.run_id, self.generation)
                    self.outcome = Outcome.NO_CODE
                    return self.outcome
                self.ending.fail(
                    "UNKNOWN_WORKFLOW", f"no workflow {run.workflow_name!r} is registered"
                )
            if run.consecutive_failures >= retrying.claim_bound(self.definition):
                self.ending.exhausted(run.consecutive_failures, run.error_message)
            self._run_workflow()
        except Suspend:
            pass
        except (LeaseLost, RunCanceled) as exc:
            logger.info("run %s: stopped: %s", self.run_id, exc)
            self.outcome = Outcome.CANCELED if isinstance(exc, RunCanceled) else Outcome.LEASE_LOST
            if isinstance(exc, RunCanceled) and run.concurrency_key is not None:
                # Ended under us, and our action has left run(): its slot may go (#35).
                if self.keeper:
                    self.keeper.leave(self.run_id, self.generation)
                else:
                    flow.leave(self.using, self.run_id, self.generation)
        except db.CommitOutcomeUnknown as exc:
            # Drop what we believe: the next claim re-reads the journal, which
            # committed (or not) in the very transaction whose outcome we lost.
            logger.warning(
                "run %s: commit outcome unknown (%s); re-reading later", self.run_id, exc
            )
            self.outcome = Outcome.COMMIT_UNKNOWN
            self.ending.release_after_unknown_commit()
        except DatabaseError as exc:
            if not weather.is_connection_error(exc):
                raise
            with contextlib.suppress(Suspend):
                self.ending.lost_connection(exc)
        finally:
            if self.keeper:
                self.keeper.untrack(self.run_id)
            if self.trace is not None:
                self.trace.end(self.outcome)
        return self.outcome

    def _verify_loaded(self, loaded: Preloaded) -> None:
        """Stop the run in ``needs_attention`` if its chains or anchors do not verify.

        A claim's preload reads under the claim's row lock. Without one (no
        preload given), an entry may commit between the reads of the row and of
        the entries: a break is confirmed on a locked re-read before it counts.
        """
        sealed = seals.start_problem(loaded.run)
        if sealed is not None:
            # Nothing of the row's start fields may reach a step: not even a retry
            # of its lock, since no later read can make a changed input the original.
            logger.error("run %s: integrity: %s", self.run_id, sealed)
            self.ending.needs_attention(codes.INTEGRITY_CHAIN_BROKEN, sealed, step=None)
        # How often its steps may run again (#47): a failure count set back outside
        # the kernel stops the run before a step sees it.
        reset = seals.attempts_problem(loaded.run)
        if reset is not None:
            logger.error("run %s: integrity: %s", self.run_id, reset)
            self.ending.needs_attention(codes.INTEGRITY_CHAIN_BROKEN, reset, step=None)
        broken = evidence.verify_run(loaded.run, loaded.journal, loaded.ledger)
        if broken is not None and self.preloaded is None:
            with transaction.atomic(using=self.using):
                db.lock_run(self.using, self.run_id)
                again = preload(self.using, [self.run_id])[self.run_id]
            if again.run.generation != self.generation or again.run.status != "running":
                raise Suspend  # taken over or canceled meanwhile: outcome "dropped"
            broken = evidence.verify_run(again.run, again.journal, again.ledger)
            if broken is None:
                self.journal.load(again)
                self.run = again.run
        if broken is not None:
            logger.error("run %s: integrity chain broken: %s", self.run_id, broken)
            self.ending.needs_attention(codes.INTEGRITY_CHAIN_BROKEN, str(broken), step=None)

    def _run_workflow(self) -> None:
        handle = RunHandle(self)
        try:
            output = self.definition.fn(handle, validation.copy_json(self.run.input))
        except StepFailed as exc:
            self.ending.fail(exc.code, exc.message)
        except (Suspend, LeaseLost, RunCanceled, db.CommitOutcomeUnknown):
            raise
        except DatabaseError as exc:
            # The kernel's own writes inside run.step: weather, not the workflow's bug.
            self.ending.retry_later(f"database error: {exc}")
        except Exception as exc:
            if weather.is_connection_error(exc):
                raise  # the database's weather, not the workflow's failure
            # Step errors never get here (``step`` turns them into retries): this is
            # the workflow function's own bug. Retrying the same code replays to the
            # same line, so one traceback and an operator, not five and backoff.
            logger.exception("run %s: workflow code raised", self.run_id)
            self._code_error(exc)
        try:
            output = to_json_value(output, "the workflow's return value")
        except InvalidInput as exc:
            self.ending.fail(codes.INVALID_WORKFLOW_OUTPUT, str(exc))
        self.ending.succeed(output)

    # -- run.step --------------------------------------------------------------

    def step(
        self,
        action: Any,
        input: Any,
        *,
        approval_ref: str | None = None,
        backup_ref: str | None = None,
    ) -> Any:
        action = as_action(action)
        self.stop_if_asked(self.next_seq)
        stopping = self.stop_requested is not None and self.stop_requested.is_set()
        if (
            stopping
            or self.next_seq in self.journal.entries
            or not (self.journal.carries_pending(action) or self.journal.rides(action))
        ):
            self.journal.flush_pending()
        # else the step's own first transaction commits the deferred success (an
        # external step's dispatch, a transactional step's atomic block), or, for a
        # PURE step after PURE ones, its success joins them (``RunJournal.rides``).
        self.check_shutdown()
        self.retry_policy = None
        seq = self.next_seq
        self.next_seq += 1
        name = action.action_name()
        try:
            # Step inputs are hashed, never stored: NUL and size are no concern here.
            text = validation.json_text(input, f"input of step {seq} ({name})", stored=False)
        except InvalidInput as exc:
            self.ending.fail(codes.INVALID_STEP_INPUT, str(exc))
        # The value as JSON gives it back, and its hash, from one canonical text: the
        # text of that value is this text (``evidence.hash_value`` would make it again).
        input = json.loads(text)
        input_hash = evidence.hash_text(text)
        entry = self.journal.get(seq)
        if entry is not None:
            return self._replay(entry, name, input, input_hash)
        self.check_parked_step(seq, name, input_hash)
        call = StepCall(seq, action, name, input, input_hash, approval_ref, backup_ref)
        if self.trace is not None:
            return self.trace.step(seq, action, input_hash, lambda: self._executed(call))
        return self._executed(call)

    def _executed(self, call: StepCall) -> Any:
        """A new step, its errors turned into the run's retry, failure or suspension."""
        seq, name = call.seq, call.name
        try:
            return self._new_step(call)
        except (StepFailed, LeaseLost, RunCanceled, db.CommitOutcomeUnknown):
            raise
        except DatabaseError as exc:
            if weather.is_connection_error(exc):
                self.ending.lost_connection(exc)
            self.ending.retry_later(f"step {seq} ({name}): database error: {exc}")
        except Exception as exc:
            if weather.is_connection_error(exc):
                self.ending.lost_connection(exc)
            # An action's hook raised (PURE, IDEMPOTENT): retryable. Handled here so
            # that it can never be mistaken for the workflow's own bug, nor be
            # swallowed by the workflow's ``except Exception``.
            self.ending.retry_later(f"step {seq} ({name}) raised {type(exc).__name__}: {exc}")

    def _new_step(self, call: StepCall) -> Any:
        seq, action, name, input = call.seq, call.action, call.name, call.input
        ctx = KernelStepContext(self, seq)
        if self.inherited_keys and action.effect == Effect.IDEMPOTENT:
            # A fork's step runs again under the key its original used: the provider
            # answers with what it did rather than doing it twice.
            ctx.effect_key = forks.key_for(self.inherited_keys, seq, name, ctx.effect_key)
        started = clock.now()
        step = Step(seq, action, name, input, call.input_hash, started, ctx)
        self.retry_policy = retrying.policy_for(action, self.definition)
        if self.run.consecutive_failures >= retrying.max_attempts(self.retry_policy):
            # Crashes in this step counted at the claims: past its own bound.
            self.ending.exhausted(self.run.consecutive_failures, self.run.error_message)
        if seq >= self.definition.max_steps:
            self.journal.step_failed(
                step,
                codes.MAX_STEPS_EXCEEDED,
                f"step {seq} is past max_steps={self.definition.max_steps}",
            )
        effect = action.effect
        refused = missing_ref(action, call.approval_ref, call.backup_ref)
        if refused is not None:
            self.journal.step_failed(step, *refused)
        step.refs = {"approval_ref": call.approval_ref, "backup_ref": call.backup_ref}
        try:
            step.cost = budgets.validate_cost(action.cost(input)) if action.defines("cost") else {}
        except budgets.CostRefused as exc:
            self.journal.step_failed(step, exc.code, f"step {seq} ({name}): {exc}")
        except Exception as exc:
            self.ending.retry_later(f"step {seq} ({name}): cost() raised {exc!r}")
        path = self._path(effect)
        if action.rate_limit is not None:
            path.admit(step, action.rate_limit)
        self.steps_executed += 1
        self._step_began = time.monotonic()
        # Its hooks may report progress; its last value is written before its end commits.
        with progress.Running(ctx):
            return path.run(step)

    def _path(self, effect: Effect) -> effects.EffectPath:
        """The path of a new step of ``effect``'s class, one per class and claim."""
        kind = effects.path_for(effect)
        path = self._paths.get(kind)
        if path is None:
            path = self._paths[kind] = kind(self, self.journal, self.ending)
        return path

    def stop_if_asked(self, seq: int) -> None:
        """A cancel was asked of this run (#49): no new step starts. The run ends canceled
        here, with the last step's deferred success (its end carries it). A journaled
        step still replays, and a step whose dispatched effect has no known outcome is
        settled first (its reconcile, or an operator): evidence is never dropped."""
        if not self._asked_now():
            return
        if seq in self.journal.entries or seq in self.journal.open_steps():
            return
        self.ending.canceled(f"canceled before step {seq}")

    def _asked_now(self) -> bool:
        """Whether a cancel was asked of this run: the lease keeper's word (a notification,
        its tick, a fence), and after a step that ran ``READ_ASKED_AFTER_S`` or longer,
        the run's row (one read): a request that came while the step ran, in the moment
        before it returned, is not left to the keeper's latency. A short step reads
        nothing: the hot path's steps cost no query."""
        if self.cancel_requested.is_set():
            return True
        began, self._step_began = self._step_began, None
        if began is None or time.monotonic() - began < READ_ASKED_AFTER_S:
            return False
        if db.fetchall(self.using, _ASKED_SQL, [self.run_id]) == [(True,)]:
            self.cancel_requested.set()
        return self.cancel_requested.is_set()

    def check_shutdown(self) -> None:
        """The worker is shutting down: hand the run back before its next step."""
        if self.stop_requested is not None and self.stop_requested.is_set():
            release(self.using, self.run_id, self.generation)
            self.outcome = Outcome.RELEASED
            events.run_changed(self, self.outcome)
            raise Suspend

    def _replay(self, entry: JournalEntry, name: str, input: Any, input_hash: str) -> Any:
        if entry.action_name != name or not evidence.same_input(
            entry.input_hash, input, input_hash
        ):
            self.diverged(entry, name, input_hash)
        if entry.state == JournalEntry.State.SUCCEEDED:
            return validation.copy_json(entry.output)
        raise StepFailed(entry.error_code, entry.error_message)

    def diverged(self, entry: JournalEntry, name: str, input_hash: str) -> NoReturn:
        """The code asks for another step than the journal holds: stop before any effect.

        Raises ``Suspend`` (not an Exception) so that a workflow's ``except
        Exception`` cannot swallow it.
        """
        message, detail = divergence.journaled_step_changed(
            entry, name, input_hash, self.definition.version
        )
        self.ending.needs_attention(
            codes.WORKFLOW_NONDETERMINISTIC, message, step=None, detail=detail
        )

    def check_parked_step(self, seq: int, name: str, input_hash: str) -> None:
        """The run parked at ``seq`` on another action: the code changed under a parked run.

        A parked step has no journal entry, so ``_replay`` has nothing to compare:
        a step inserted at the parked position ran as a new step and moved the
        waiting action one on, under another ``effect_key``. The run row keeps the
        parked action's name (read by the claim: no query), and a mismatch is
        the same incident as a journaled step that changed.
        """
        parked = self.run.wait_action
        if seq != self.run.wait_step or not parked or parked == name:
            return
        message, detail = divergence.parked_step_changed(
            seq, parked, name, input_hash, self.definition.version
        )
        self.ending.needs_attention(
            codes.WORKFLOW_NONDETERMINISTIC, message, step=None, detail=detail
        )

    def _code_error(self, exc: Exception) -> NoReturn:
        message, detail = divergence.code_error(exc, self.definition.version)
        self.ending.needs_attention(codes.WORKFLOW_CODE_ERROR, message, step=None, detail=detail)

    # -- run.patched (``patches.py``) ---------------------------------------

    def patched(self, patch_id: str) -> bool:
        """``run.patched``: True for a run at this point under the new code, journaled."""
        return patches.patched(self, patch_id)

    def deprecate_patch(self, patch_id: str) -> None:
        """``run.deprecate_patch``: consume the marker where the run has one; journal nothing."""
        patches.deprecate_patch(self, patch_id)

    # -- markers: steps of the kernel's own (timers) ----------------------------

    def sleep(self, duration: Any = None, until: Any = None) -> None:
        """``run.sleep`` / ``run.sleep_until``: a durable timer (``timers.py``)."""
        timers.sleep(self, duration=duration, until=until)

    def begin_marker(self) -> int:
        """Take the next position for a kernel step, after the previous step's success."""
        self.stop_if_asked(self.next_seq)
        self.journal.flush_pending()
        self.check_shutdown()
        self.retry_policy = None
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def replay_marker(self, entry: JournalEntry, name: str, input: Any, input_hash: str) -> Any:
        """A journaled kernel step: its output, or a nondeterminism incident."""
        return self._replay(entry, name, input, input_hash)

    def marker_step(self, seq: int, action: Action, name: str, input: Any, input_hash: str) -> Step:
        return Step(seq, action, name, input, input_hash, clock.now(), KernelStepContext(self, seq))

    def journal_marker(self, step: Step, result: Succeeded) -> Any:
        return self.journal.journal_success(step, result)

    def park_marker(self, seq: int, name: str, dependency: Any) -> NoReturn:
        self.ending.park(seq, name, dependency)

    # -- run.children (``fanout.py``) ----------------------------------------

    def children(self, name: str, inputs: list[Any], *, wait: bool = True) -> Any:
        """``run.children`` (``wait``) or ``create_child_workflow_runs(run, ...)`` (not)."""
        return fanout.children_step(self, name, inputs, wait=wait)


def _has_other_versions(name: str) -> bool:
    return name in registered_workflows()
