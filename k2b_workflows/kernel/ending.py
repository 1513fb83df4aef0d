"""How a claim of a run ends: succeed, fail, park, retry later, or hand it to an operator.

Each end is one fenced transaction that also carries the last step's deferred
success (``RunJournal.pending``): the end costs no commit of its own. A
success verifies the run's chains before it commits, in the statement that
ends the run when this execution wrote every entry itself (``end_as_written``),
else by a read in the same transaction (``end_as_read``). Every end but a
release seals the run (``ended.seal``) and is told once it commits
(``ended.told``), as every other path that ends a run does.

Every method here that ends the claim raises ``Suspend`` (a BaseException), so
that a workflow's ``except Exception`` cannot swallow it; they are typed
``NoReturn``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from django.db import DatabaseError

from .. import codes, redaction
from ..actions import Effect
from ..exceptions import LeaseLost, RunCanceled, Suspend
from ..models import JournalEntry, LedgerEntry
from ..validation import canonical_json
from . import children, db, ended, events, evidence, interventions, retrying, waits, weather
from .claim import release
from .journal import Batch, Claim, Pending, RunJournal, Step
from .load import Preloaded, chains_read, chains_sql, preload
from .requeue import AFTER_MS, P, requeue_set

if TYPE_CHECKING:
    from ..actions import Dependency

logger = logging.getLogger(__name__)


class Outcome(enum.StrEnum):
    """How one claim of a run ended: the worker's statistics, the trace, the metrics."""

    DROPPED = "dropped"  # not ours when we looked: taken over, canceled, ended
    NO_CODE = "no_code"  # no code for its version here: handed back
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    NEEDS_ATTENTION = "needs_attention"
    RETRY = "retry"  # a retryable failure: queued again after a backoff
    WAITING = "waiting"  # parked on a dependency
    REWOKEN = "rewoken"  # parked, and its dependency had already fired: queued again
    DEFERRED = "deferred"  # a rate limit's window is full: queued for when it frees
    RELEASED = "released"  # the worker is shutting down: handed back
    LEASE_LOST = "lease_lost"
    CANCELED = "canceled"
    COMMIT_UNKNOWN = "commit_unknown"  # a commit lost its answer: re-read by the next claim
    DB_UNAVAILABLE = "db_unavailable"


#: A run's success, fenced like every write. ``{verified}``: the check of the
#: chains as this execution wrote them (``evidence.AS_WRITTEN_CHECK``), or nothing.
_SUCCEED_TEMPLATE = """
UPDATE k2b_run
   SET status = 'succeeded', output = %s::jsonb, end_seal = %s, error_code = '',
       error_message = '', finished_at = k2b_now(), lease_expires_at = NULL,
       consecutive_failures = 0, updated_at = k2b_now()
 WHERE id = %s AND generation = %s AND status = 'running'{verified}
RETURNING id
"""
SUCCEED_SQL = _SUCCEED_TEMPLATE.format(verified="")
#: The same, once it has found the run's chains as its execution wrote them.
SUCCEED_AS_WRITTEN_SQL = _SUCCEED_TEMPLATE.format(verified=evidence.AS_WRITTEN_CHECK)

FAIL_SQL = """
UPDATE k2b_run
   SET status = 'failed', error_code = %s, error_message = %s, end_seal = %s,
       finished_at = k2b_now(), lease_expires_at = NULL, updated_at = k2b_now()
 WHERE id = %s
"""

NEEDS_ATTENTION_SQL = """
UPDATE k2b_run
   SET status = 'needs_attention', error_code = %s, error_message = %s, error_detail = %s,
       attention_step = %s, end_seal = %s, lease_expires_at = NULL, updated_at = k2b_now()
 WHERE id = %s
"""

#: A run whose call was asked to stop (``tasks.cancel``) and then failed, crashed or
#: would be retried: ended canceled by the claim that owns it, fenced like every end.
CANCELED_SQL = """
UPDATE k2b_run
   SET status = 'canceled', error_code = %s,
       error_message = CASE WHEN cancel_reason = '' THEN %s
                            ELSE cancel_reason || ' (' || %s || ')' END,
       end_seal = %s, finished_at = k2b_now(), lease_expires_at = NULL, updated_at = k2b_now()
 WHERE id = %s
"""

RETRY_LATER_SQL = f"""
UPDATE k2b_run
   SET {requeue_set(release=True, consecutive_failures=P, run_after=AFTER_MS, error_message=P)}
 WHERE id = %s
"""


class RunEnding:
    """The ends of one claim of a run, written through its journal."""

    def __init__(self, claim: Claim, journal: RunJournal) -> None:
        self.claim = claim
        self.journal = journal
        self.using = claim.using
        self.run_id = claim.run_id
        self.generation = claim.generation

    def ended(self, outcome: Outcome, *, step: int | None = None, reason: str = "") -> NoReturn:
        """Tell the committed end, and leave the workflow code."""
        events.run_changed(self.claim, outcome, step, reason=reason)
        self.claim.outcome = outcome
        raise Suspend

    # -- success -------------------------------------------------------------

    def succeed(self, output: Any) -> None:
        """End the run with ``output``: verified, fenced and sealed, in as few round trips
        as the run allows. Returns once the run's end was written (or refused).

        A run canceled (or taken over) while its last step ran is not this claim's
        to end: the end is refused by the fence, the step's result kept as late
        evidence where the kernel keeps one (``RunJournal.pending_lost``), and the
        error raised says so in one line (``late_end``)."""
        pending = self.journal.pending
        try:
            with contextlib.suppress(Suspend):
                if self.claim.canceled.is_set():
                    # The lease keeper saw the run end or change hands under the step (or
                    # the step's timeout pass): ask before sending an end it may not write.
                    self.refuse_unless_ours(pending)
                if pending is None or pending.ledger_kind is None or self._batches_end():
                    # Returns only when batched writes were refused: nothing was written.
                    self._finish(output, pending)
                run_output = canonical_json(output)
                self.transition(
                    SUCCEED_SQL,
                    [
                        run_output,
                        self.end_seal("succeeded", "", run_output),
                        self.run_id,
                        self.generation,
                    ],
                    Outcome.SUCCEEDED,
                    terminal=True,
                    verify=True,
                    told={"error_code": ""},
                )
        except (LeaseLost, RunCanceled) as exc:
            raise self.late_end(exc, pending) from exc

    def refuse_unless_ours(self, pending: Pending | None) -> None:
        """Raise the fence's error (``RunCanceled``, ``LeaseLost``) when this claim no
        longer holds the run, ``pending`` kept as late evidence where the kernel keeps
        one; return when it still does.

        For a writer that learned only that its batched end was refused
        (``db.BatchRefused``: the fence, or a chain moved by someone else) or that
        the keeper raised the abort signal: an end of a run that is not its own is
        not tried again, one way after another, for the database to refuse each time.
        """
        lost = db.not_ours(self.using, self.run_id, self.generation)
        if lost is not None:
            self.journal.pending_lost(pending)
            raise lost

    def late_end(
        self, exc: LeaseLost | RunCanceled, pending: Pending | None
    ) -> LeaseLost | RunCanceled:
        """``exc`` saying what became of the result this claim could not end the run with:
        the worker logs it as the one line of this claim's end (``Execution.execute``)."""
        if pending is None:
            what = "its end is not written"
        elif pending.ledger_kind:
            what = "its result is recorded as late evidence, not as the run's end"
        else:
            what = "its result is dropped, not written as the run's end"
        if not isinstance(exc, RunCanceled):
            return LeaseLost(f"{exc}: {what}")
        when = "while its step ran" if pending is not None else "before this worker ended it"
        return RunCanceled(f"run {self.run_id} was canceled {when}: {what}")

    def _batches_end(self) -> bool:
        """Whether the run's end may go as batched statements (``end_as_written``, or
        "BEGIN; read" then "writes; COMMIT"); a child, which also wakes its parent,
        goes through Django's transaction."""
        return not self.claim.run.parent_id and db.batches_statements(self.using)

    def _finish(self, output: Any, pending: Pending | None) -> None:
        """The common end: the chains verified, then the run's end in one statement that
        fences and, with the last step's deferred success, journals and seals.

        When this execution wrote every entry of the run, that statement verifies
        them itself (``end_as_written``): one round trip. Otherwise, or when it
        finds anything else, the chains are read and verified (``end_as_read``).
        Returns only when batched writes were refused: nothing was written.
        """
        ended = self._batches_end() and self.end_as_written(output, pending)
        if not ended and not self.end_as_read(output, pending):
            return
        self.journal.pending_committed(pending)
        self._told(Outcome.SUCCEEDED, error_code="")
        self.ended(Outcome.SUCCEEDED)

    def end_as_written(self, output: Any, pending: Pending | None) -> bool:
        """The run's end in one round trip: ``BEGIN; <end>; COMMIT``, the end verifying
        the chains as it fences (``evidence.AS_WRITTEN_CHECK``).

        The design verifies the chains before a success commits. An entry this
        execution verified at its claim, or hashed and inserted itself, is still
        that entry if its row version is: the end's statement compares the row
        version of every entry, and the run row's anchors, with what this execution
        wrote, in the transaction that commits the success, and ends the run only
        when they are equal. Anything else (an entry edited, removed or added by
        anyone, an anchor rewritten, the lease lost) writes nothing, and the caller
        reads and verifies the chains as before, which says what broke.
        """
        chains = self.journal.written_chains()
        if chains is None:
            return False
        batch = _end_batch(self, output, pending, chains)
        together = self.claim.together
        if together is not None and not _pure_only(pending):
            together = None  # an effect's success never waits for other runs' ends
        try:
            if together is not None:
                rows = together.commit(batch.statements)
            else:
                rows = db.commit_batch(self.using, batch.statements)
        except db.BatchRefused as exc:
            # By the fence (not ours any more), or by the check of the chains.
            self.refuse_unless_ours(pending)
            logger.info("run %s: end as written refused (%s)", self.run_id, exc)
            return False
        if evidence.written_row(rows[0]) is None:  # nothing ended: an empty transaction
            return False
        if pending is not None:
            evidence.fenced_journal_written(pending.entries, self.using, rows[0])
        batch.committed(rows)
        return True

    def end_as_read(self, output: Any, pending: Pending | None) -> bool:
        """The run's end after a read of its chains, verified here.

        The verifying read is one statement, so the run row (its anchors) and every
        entry come from one snapshot: an append commits both or neither, so the view
        is consistent without a lock. Read and write share one transaction: one
        commit, and two round trips where statements can be batched ("BEGIN; read",
        "writes; COMMIT"); a child goes through Django's transaction. A break rolls
        back and leaves the run to ``needs_attention``, the deferred success with
        it, as ``transition`` does.

        An EXTERNAL step's deferred success also has its ledger entry: then only
        batched, as strict appends (``Batch``), and this returns False, having
        written nothing, when they are refused (``transition`` then ends the run).
        """
        batch = _end_batch(self, output, pending)
        sql, params = batch.statements[0]
        broken: list[str] = []

        def finished(row: tuple | None) -> None:
            if pending is not None:
                evidence.fenced_journal_written(pending.entries, self.using, row)
            elif row is None:
                raise db.lease_lost(self.using, self.run_id, self.generation)

        def verified(loaded: dict[Any, Preloaded]) -> bool:
            problem = self.chains_problem(loaded)
            if problem:
                broken.append(problem)
            return not problem

        def write() -> None:
            if verified(preload(self.using, [self.run_id])):
                written = db.fetch_statement(self.using, sql, list(params))
                finished(written[0] if written else None)
                if self.claim.run.parent_id:
                    children.wake_parent(self.using, self.claim.run)

        try:
            if not self._batches_end():
                db.run_in_transaction(write, self.using)
            else:
                written, rows = db.read_then_write(
                    self.using,
                    chains_sql(),
                    [self.run_id],
                    lambda rows: (
                        batch.statements if verified(chains_read(self.using, rows)) else None
                    ),
                )
                if written:
                    finished(rows[0])
                    batch.committed(rows)
        except db.BatchRefused as exc:
            self.refuse_unless_ours(pending)
            logger.info("run %s: batched end refused (%s)", self.run_id, exc)
            return False
        except (LeaseLost, RunCanceled):
            self.journal.pending_lost(pending)
            raise
        if broken:
            self.chain_broken(broken[0])
        return True

    # -- the other ends --------------------------------------------------------

    def transition(
        self,
        sql: str,
        params: list[Any],
        outcome: Outcome,
        *,
        terminal: bool,
        entry: JournalEntry | None = None,
        verify: bool = False,
        told: dict[str, Any] | None = None,
        reason: str = "",
        also: Callable[[], None] | None = None,
    ) -> NoReturn:
        """Fence, then change the run's status (and wake a parent when it ends).

        ``sql`` and ``params``: the statement that changes the run row, whole.
        ``told``: the run ended (or was handed to an operator): what ``ended.told``
        says of it once this commits, beside its status (its error code, and for an
        operator the message and the step).
        ``reason``: the (already scrubbed) why, logged with the change.
        ``also``: more of the same end, written after the run row in its transaction.
        """
        journal = self.journal
        run = self.claim.run
        broken: list[str] = []
        pending = journal.pending

        def write() -> None:
            if pending is not None:
                journal.fence(pending.step.seq, reset_failures=True)
            else:
                journal.fence()
            if verify:
                # The fence holds the row lock, and this statement's snapshot is newer
                # than the lock: every entry of the run is in it. One round trip.
                problem = self.chains_problem(preload(self.using, [self.run_id]))
                if problem is not None:
                    broken.append(problem)
                    return
            prev = journal.last_hash
            if pending is not None:
                # The last step's success commits with the run's end: one commit, not two.
                prev = journal.write_pending(pending)
            if entry is not None:
                evidence.append_journal(entry, prev, self.using)
            db.execute(self.using, sql, params)
            if also is not None:
                also()
            if terminal and run.parent_id:
                children.wake_parent(self.using, run)

        try:
            db.run_in_transaction(write, self.using)
        except (LeaseLost, RunCanceled):
            journal.pending_lost(pending)
            raise
        if broken:
            self.chain_broken(broken[0])
        journal.pending_committed(pending)
        if entry is not None:
            journal.journaled(entry)
        if told is not None:
            self._told(outcome, **told)
        self.ended(outcome, reason=reason)

    def chains_problem(self, loaded: dict[Any, Preloaded]) -> str | None:
        """What breaks this run's chains in a fresh read of it (``preload``), or None."""
        again = loaded.get(self.run_id)
        problem = again and evidence.verify_run(again.run, again.journal, again.ledger)
        return str(problem) if problem else None

    def chain_broken(self, problem: str) -> NoReturn:
        """The chains did not verify, and nothing committed. The run needs attention;
        the deferred success, if any, goes with the incident."""
        logger.error("run %s: integrity chain broken: %s", self.run_id, problem)
        self.needs_attention(codes.INTEGRITY_CHAIN_BROKEN, problem, step=None)

    def end_seal(self, status: str, code: str, output_text: str = "null") -> str:
        """The seal of this run ending (or parking for an operator) in this generation."""
        return ended.seal(self.run_id, status, code, self.generation, output_text)

    def _told(self, status: str, **told: Any) -> None:
        """``ended.told`` of this claim's end, its ledger as this execution wrote it."""
        ended.told(
            self.using,
            run_id=self.run_id,
            workflow_name=self.claim.run.workflow_name,
            status=status,
            generation=self.generation,
            ledger=self.journal.ledger_end(),
            **told,
        )

    def canceled(self, message: str) -> NoReturn:
        """End the run canceled: it was asked to stop (``tasks.cancel``,
        ``cancel_workflow_run``) and its call did not return normally, or it reached its
        next step (#49). ``message``: what became of it, after the cancel's reason.

        With it, in its transaction: its children are asked in turn (those its
        current step made since the cancel too) and its AI tasks end, as a cancel
        ends those of a run it ends at once."""
        message = redaction.scrub_error(message)

        def children_too() -> None:
            interventions.ask_children(self.using, self.run_id)
            db.execute(self.using, interventions.CANCEL_AI_TASKS_SQL, [[self.run_id]])

        self.transition(
            CANCELED_SQL,
            [
                codes.CANCELED,
                message,
                message,
                self.end_seal("canceled", codes.CANCELED),
                self.run_id,
            ],
            Outcome.CANCELED,
            terminal=True,
            told={"error_code": codes.CANCELED},
            reason=f"{codes.CANCELED}: {message}",
            also=children_too,
        )

    def fail(self, code: str, message: str, step: Step | None = None) -> NoReturn:
        """Fail the run for good (journaling the step's failure when there is one)."""
        message = redaction.scrub_error(message)  # exception texts may carry credentials
        if self.claim.cancel_requested.is_set():
            # Asked to stop, then failed: the call ends as canceled (#49).
            self.canceled(f"{code}: {message}")
        entry = None
        if step is not None and step.seq not in self.journal.entries:
            entry = self.journal.new_entry(
                step, JournalEntry.State.FAILED, code=code, message=message
            )
        self.transition(
            FAIL_SQL,
            [code, message, self.end_seal("failed", code), self.run_id],
            Outcome.FAILED,
            terminal=True,
            entry=entry,
            told={"error_code": code},
            reason=f"{code}: {message}",
        )

    def needs_attention(
        self, code: str, message: str, step: int | None, detail: dict | None = None
    ) -> NoReturn:
        """Hand the run to an operator, with what is known (``detail``) and the step in doubt."""
        message = redaction.scrub_error(message)
        self.transition(
            NEEDS_ATTENTION_SQL,
            [
                code,
                message,
                canonical_json(detail) if detail else None,
                step,
                self.end_seal("needs_attention", code),
                self.run_id,
            ],
            Outcome.NEEDS_ATTENTION,
            terminal=False,
            told={"error_code": code, "message": message, "step": step},
            reason=f"{code}: {message}",
        )

    def retry_later(self, reason: str, delay_ms: int | None = None) -> NoReturn:
        """A retryable failure: count it, back off, or give up past the limit.

        ``delay_ms``: the failure's own delay (``Failed.delay_ms``), else the policy's."""
        reason = redaction.scrub_error(reason)  # stored and logged: no credentials, bounded
        if self.claim.cancel_requested.is_set():
            # A canceled call is never retried (#49); a cancel the keeper has not seen
            # yet is caught by the claim that would retry it (``Execution.execute``).
            self.canceled(reason)
        failures = self.claim.run.consecutive_failures + 1
        policy = self.claim.retry_policy
        if failures >= retrying.max_attempts(policy):
            self.exhausted(failures, reason)
        delay = retrying.delay_ms(policy, failures) if delay_ms is None else delay_ms
        logger.info("run %s: retry %s in %s ms: %s", self.run_id, failures, delay, reason)
        self.transition(
            RETRY_LATER_SQL,
            [failures, delay, reason, self.run_id],
            Outcome.RETRY,
            terminal=False,
        )

    def exhausted(self, failures: int, reason: str) -> NoReturn:
        """Past the retry bound: fail, unless an effect may have happened."""
        message = f"{failures} consecutive failures; last: {reason}"
        open_steps = self.journal.open_steps()
        if open_steps:
            # An effect may have happened: never just fail, an operator decides.
            self.needs_attention(codes.WORKFLOW_RETRY_EXHAUSTED, message, step=open_steps[0])
        self.fail(codes.WORKFLOW_RETRY_EXHAUSTED, message)

    def park(
        self,
        seq: int,
        action: str,
        dependency: Dependency,
        pending: tuple[Step, str] | None = None,
    ) -> NoReturn:
        """Park on ``dependency``; with ``pending``, also record the provider's "pending"."""
        run = self.claim.run
        parked: list[bool] = []
        # PURE successes before this step ride on the park (``RunJournal.rides``).
        deferred = self.journal.pending
        if pending is None and self.claim.cancel_requested.is_set():
            # Asked to stop (#49): a step that would wait ends the run instead. A
            # provider's "pending" is an effect in doubt: it parks, and is settled first.
            self.canceled(f"canceled at step {seq}, which was to wait")
        asked: list[bool] = []

        def write() -> None:
            if self.journal.fence(seq) and pending is None:
                asked.append(True)  # the cancel committed before this park: nothing written
                return
            if deferred is not None:
                self.journal.write_pending(deferred)
            if pending is not None:
                self.journal.ledger(pending[0], LedgerEntry.Kind.PENDING, message=pending[1])
            parked.append(
                waits.park(
                    self.using,
                    run_id=self.run_id,
                    app_id=self.claim.app_id,
                    step=seq,
                    dependency=dependency,
                    action=action,
                    seen_kind=run.wait_kind,
                    seen_key=run.wait_key,
                    seen_seq=run.wait_signal_seq,
                    reset=self.journal.reset,
                )
            )

        try:
            db.run_in_transaction(write, self.using)
        except (LeaseLost, RunCanceled):
            self.journal.pending_lost(deferred)
            raise
        if asked:
            self.canceled(f"canceled at step {seq}, which was to wait")
        self.journal.pending_committed(deferred)
        outcome = Outcome.WAITING if parked[-1] else Outcome.REWOKEN
        if self.claim.trace is not None:
            self.claim.trace.waiting(seq, dependency)
        self.ended(outcome, step=seq)

    def parked(self, seq: int, parked: bool) -> NoReturn:
        """A park written by the caller's own transaction (a children step) committed."""
        self.ended(Outcome.WAITING if parked else Outcome.REWOKEN, step=seq)

    def lost_connection(self, exc: BaseException) -> NoReturn:
        """The connection died under a step (a restart, a failover, a terminated backend).

        Whatever that transaction wrote either committed with its journal entry or
        not at all: the same path as an unknown commit. It is not the run's
        failure, so none is counted, and ``Suspend`` leaves the workflow code
        without its ``except Exception`` seeing the error.
        """
        logger.warning(
            "run %s: database unavailable (%s); handing the run back",
            self.run_id,
            weather.describe(exc),
        )
        self.claim.outcome = Outcome.DB_UNAVAILABLE
        self.release_after_unknown_commit()
        raise Suspend

    def release_after_unknown_commit(self) -> None:
        """Hand the run back on a fresh connection; the worker retries it if even that fails."""
        weather.close_quietly(self.using)
        try:
            release(self.using, self.run_id, self.generation)
        except DatabaseError:
            weather.close_quietly(self.using)
            self.claim.release_pending = True


def _end_batch(
    ending: RunEnding,
    output: Any,
    pending: Pending | None,
    chains: evidence.WrittenChains | None = None,
) -> Batch:
    """The run's end as a batch, for ``ending`` to commit: the statement that fences and
    ends the run (with the last step's deferred success, journaling and sealing it),
    then that success's ledger entry if it has one (then strict). With ``chains`` the
    first statement also checks them as written (``evidence.AS_WRITTEN_CHECK``),
    strict too. A module function: it builds statements and holds no state of the end."""
    run_output = canonical_json(output)
    sealed = ending.end_seal("succeeded", "", run_output)
    if pending is not None:
        sql, params = evidence.fenced_journal_statement(
            pending.entries,
            ending.journal.last_hash,
            run_output=run_output,
            end_seal=sealed,
            strict=pending.ledger_kind is not None,
            as_written=chains,
        )
    elif chains is not None:
        sql = SUCCEED_AS_WRITTEN_SQL
        params = [run_output, sealed, ending.run_id, ending.generation, *chains.params()]
    else:
        sql, params = SUCCEED_SQL, [run_output, sealed, ending.run_id, ending.generation]
    batch = Batch(ending.journal)
    batch.add((sql, params), pending.entries if pending is not None else None)
    if pending is not None:
        batch.pending_ledger(pending)  # nothing for a success without a ledger kind
    return batch


def _pure_only(pending: Pending | None) -> bool:
    """Whether a run's end carrying ``pending`` (its deferred successes) writes nothing
    but pure work (no entry of another effect, no ledger entry): only such an end may
    wait to commit with other runs' (``together.py``)."""
    if pending is None:
        return True
    return pending.ledger_kind is None and all(
        entry.effect == Effect.PURE.value for entry in pending.entries
    )
