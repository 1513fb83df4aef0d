"""A claimed run's journal and ledger: their state in memory and every write to them.

``RunJournal`` is the one owner of what an execution knows of its run's
chains: the journal entries by position, the hash the next entry chains to,
where the ledger ends, each step's open effect, and the step's success not
committed yet. Every write to the journal or the ledger goes through it, and
every write fences the run in its transaction (``db.fence``, or a statement
that fences itself): a worker whose lease was taken over can compute but
never commit.

The in-memory state follows the database, never leads it: an entry is
applied (``journaled``) only after the transaction that wrote it committed.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from .. import redaction, settings, validation
from ..actions import Action, Effect, Succeeded
from ..exceptions import LeaseLost, RunCanceled, StepFailed
from ..models import JournalEntry, LedgerEntry, WorkflowRun
from . import attempts, budgets, clock, contradictions, db, events, evidence, instances

if TYPE_CHECKING:
    from ..retries import Retry
    from ..tracing import RunTrace
    from .context import KernelStepContext
    from .leases import LeaseKeeper
    from .load import Preloaded
    from .together import EndsTogether

logger = logging.getLogger(__name__)

#: Ledger kinds that close an invocation of an effect: after one of these the
#: next dispatch is a new invocation with a new key (and the same effect key).
CLOSING_KINDS = frozenset(
    {
        LedgerEntry.Kind.SUCCEEDED,
        LedgerEntry.Kind.FAILED,
        LedgerEntry.Kind.RECONCILED,
        LedgerEntry.Kind.RESOLVED_CONFIRMED,
        LedgerEntry.Kind.RESOLVED_ABSENT,
        LedgerEntry.Kind.REJECTED,
    }
)


class Claim(Protocol):
    """What the journal, the effect paths and the run's end read of the claim they serve
    (``execute.Execution`` is the one implementation)."""

    run_id: uuid.UUID
    generation: int
    using: str
    run: WorkflowRun
    root_id: uuid.UUID
    app_id: str
    principal: Any
    keeper: LeaseKeeper | None
    #: The retry policy of the step being executed, if any.
    retry_policy: Retry | None
    trace: RunTrace | None
    #: How this claim ended (``ending.Outcome``), set by whatever ends it.
    outcome: str
    #: The run could not be released after a lost connection: the worker must.
    release_pending: bool
    #: Where a pure end may commit with the next runs' ends (``together.py``), or None.
    together: EndsTogether | None
    #: The abort signal: set by the lease keeper when the run ended or changed hands
    #: under the claim (or its step's timeout passed), read before the run's end.
    canceled: threading.Event
    #: Set by the lease keeper (or a fence) when a cancel asked the run to stop (#49):
    #: the claim still owns the run, but no retry of it starts.
    cancel_requested: threading.Event


@dataclass
class EffectState:
    """What the ledger says about one step's external effect."""

    attempts: int = 0  # invocations dispatched so far
    open_key: str | None = None  # invocation dispatched with no known outcome
    polls: int = 0  # reconcile() answers "pending" since the last dispatch


@dataclass
class Step:
    """One new step being executed: what it runs, on what, and what it carries."""

    seq: int
    action: Action
    name: str
    input: Any
    input_hash: str
    started: dt.datetime
    ctx: KernelStepContext
    cost: dict[str, int] = field(default_factory=dict)
    refs: dict[str, Any] = field(default_factory=dict)
    #: A reserved rate-limited dispatch, stamped just before ``run()`` (``flow.py``).
    rate_dispatch: int | None = None


#: PURE successes riding on one write at most: past these, the next one writes them. A
#: long loop of PURE steps then commits a few times, not once per step, and no
#: statement grows without bound (nor what a crash makes run again).
MAX_RIDING = 32


@dataclass
class Pending:
    """A step's success whose journal entry (and ledger entry) is not committed yet.

    ``riding``: the entries of earlier PURE steps whose successes wait for the same
    write (``RunJournal.rides``), in order; written before ``entry``, in the same
    statement where one can carry them all. A crash before that write loses them,
    and the replay runs those PURE steps again, as DESIGN.md promises for PURE.
    """

    step: Step
    entry: JournalEntry
    ledger_kind: str | None
    output: Any
    riding: list[JournalEntry] = field(default_factory=list)

    @property
    def entries(self) -> list[JournalEntry]:
        """Every entry this deferred success writes, in chain order."""
        return [*self.riding, self.entry]


class RunJournal:
    """The journal and ledger of one claimed run, as this execution knows them."""

    def __init__(self, claim: Claim, loaded: Preloaded) -> None:
        self.claim = claim
        self.using = claim.using
        self.run_id = claim.run_id
        self.generation = claim.generation
        #: Journal entries by position.
        self.entries: dict[int, JournalEntry] = {}
        #: The hash the next journal entry chains to.
        self.last_hash = evidence.GENESIS
        #: Where the run's ledger chain ends, as far as this execution knows (a hint
        #: that saves the append a read; the append checks it).
        self.ledger_head = evidence.LedgerHead.loaded([])
        #: Each chain's entry count and the run row's anchor over it, as claimed.
        self.loaded_anchors: dict[str, tuple[int, str]] = {}
        #: Steps with an external effect and no journal entry, by position.
        self.effects: dict[int, EffectState] = {}
        #: A step's success not committed yet, with the PURE successes before it that
        #: ride on the same write: they commit with the next write of this run (the
        #: next non-PURE step's first transaction, a park, or the run's end), see
        #: ``journal_success``.
        self.pending: Pending | None = None
        #: The reset of the run's failures that this claim's completed steps carry
        #: (``attempts.py``): prepared once, when the claimed run counts failures.
        self.reset: attempts.Reset | None = attempts.for_run(loaded.run)
        self.load(loaded)

    def load(self, loaded: Preloaded) -> None:
        """Take the state of the chains from a read of them (the claim's, or a re-read)."""
        entries = loaded.journal
        self.entries = {e.seq: e for e in entries}
        self.loaded_anchors = {
            "journal": (len(entries), loaded.run.journal_anchor),
            "ledger": (len(loaded.ledger), loaded.run.ledger_anchor),
        }
        self.ledger_head = evidence.LedgerHead.loaded(loaded.ledger)
        self.last_hash = entries[-1].entry_hash if entries else evidence.GENESIS
        self.effects = {}
        for entry in loaded.ledger:
            if entry.seq is None or entry.seq in self.entries:
                continue
            state = self.effects.setdefault(entry.seq, EffectState())
            if entry.kind == LedgerEntry.Kind.DISPATCHED:
                state.attempts += 1
                state.open_key = entry.invocation_key
                state.polls = 0
            elif entry.kind == LedgerEntry.Kind.PENDING:
                state.polls += 1
            elif entry.kind in CLOSING_KINDS:
                state.open_key = None

    def get(self, seq: int) -> JournalEntry | None:
        """The journal entry at ``seq``, if the run has one."""
        return self.entries.get(seq)

    def open_steps(self) -> list[int]:
        """Steps whose effect was dispatched with no known outcome."""
        return [seq for seq, state in self.effects.items() if state.open_key]

    # -- fence and charge ----------------------------------------------------

    def fence(self, step: int | None = None, *, reset_failures: bool = False) -> bool:
        """Lock our run row in the current transaction and check we still own it;
        ``reset_failures``: a step completes, the failures before it no longer count.
        Returns whether a cancel asked the run to stop (#49), and tells the claim: the
        next step boundary then ends the run (``Execution.stop_if_asked``), whether or
        not the lease keeper has looked yet."""
        asked = db.fence(
            self.using,
            self.run_id,
            self.generation,
            settings.lease_ms(),
            step,
            reset=self.reset if reset_failures else None,
        )
        if asked:
            self.claim.cancel_requested.set()
        return asked

    def charge(self, step: Step) -> None:
        """Charge the step's cost to the root's budget, in the current transaction, once."""
        budgets.charge(
            self.using,
            root_id=self.claim.root_id,
            run_id=self.run_id,
            seq=step.seq,
            cost=step.cost,
        )

    # -- journal entries -----------------------------------------------------

    def new_entry(
        self,
        step: Step,
        state: str,
        result: Succeeded | None = None,
        code: str = "",
        message: str = "",
    ) -> JournalEntry:
        """An entry for ``step``, not written yet."""
        return instances.fresh(
            JournalEntry,
            {
                "run_id": self.run_id,
                "seq": step.seq,
                "action_name": step.name,
                "effect": step.action.effect.value,
                "state": state,
                "output": result.output if result else None,
                "summary": (result.summary or "") if result else "",
                "error_code": code,
                "error_message": redaction.scrub_error(message) if message else "",
                "input_hash": step.input_hash,
                "generation": self.generation,
                "started_at": step.started,
                "created_at": clock.now(),
            },
        )

    def journaled(self, entry: JournalEntry) -> None:
        """Only after the commit: the in-memory journal follows the database, never leads it."""
        self.entries[entry.seq] = entry
        self.last_hash = entry.entry_hash
        self.effects.pop(entry.seq, None)
        # A completed step resets the counter (the fence did it in the row): a later
        # failure in this claim must count from zero, not from before the step.
        self.claim.run.consecutive_failures = 0
        events.step_journaled(self.claim, entry)

    def rides(self, action: Action) -> bool:
        """Whether a new step of ``action`` leaves the deferred success where it is: a
        PURE step after PURE successes. Its own success then joins them
        (``journal_success``), and all of them ride on the run's next write."""
        pending = self.pending
        return (
            action.effect == Effect.PURE
            and pending is not None
            and pending.step.action.effect == Effect.PURE
            and pending.ledger_kind is None
            and len(pending.riding) < MAX_RIDING
        )

    def carries_pending(self, action: Action) -> bool:
        """Whether a new step of ``action`` writes the deferred success itself, in its
        first transaction: an EXTERNAL step's dispatch always; a TRANSACTIONAL
        step's block when the success has no ledger entry, its fenced append then
        being the first statement of the block."""
        if action.effect.is_external:
            return True
        pending = self.pending
        return (
            action.effect == Effect.TRANSACTIONAL
            and pending is not None
            and pending.ledger_kind is None
        )

    def journal_success(
        self,
        step: Step,
        result: Succeeded,
        *,
        charge: bool = False,
        ledger_kind: str | None = None,
    ) -> Any:
        """Record a step's success: committed with this run's next write, not on its own.

        The workflow code between two steps does no I/O, so the entry can wait
        for the next step's start (``flush_pending``; an EXTERNAL step's dispatch
        and a TRANSACTIONAL step's block write it themselves, ``carries_pending``)
        or for the run's end, whose transaction then writes both: the finish
        costs no commit of its own. A PURE step's success waits further: past
        the PURE steps after it (``rides``), to the next non-PURE step's write, a
        park or the end, in one statement with theirs. A crash in between loses
        only what a crash before the commit always lost: a PURE or IDEMPOTENT step
        runs again (same ``effect_key``), an EXTERNAL one is reconciled. A charge
        is never deferred: its failure (``EFFECT_BUDGET_EXCEEDED``) belongs to
        this step.
        """
        # A PURE success joins the PURE successes before it (``rides``). Every other
        # path that journals flushes first; should one not, the earlier success is
        # written now rather than replaced (a gap in the journal).
        earlier = self.pending
        riding: list[JournalEntry] = []
        if not charge and earlier is not None and self.rides(step.action):
            riding = earlier.entries
            self.pending = None
        else:
            self.flush_pending()
        entry = self.new_entry(step, JournalEntry.State.SUCCEEDED, result)
        if not charge:
            self.pending = Pending(step, entry, ledger_kind, result.output, riding)
            # As ``journaled`` will: a completed step resets the failure count and
            # closes its effect, which a transition merged with it must see.
            self.claim.run.consecutive_failures = 0
            self.effects.pop(step.seq, None)
            return validation.copy_json(entry.output)

        def write() -> None:
            self.fence(step.seq, reset_failures=True)
            self.charge(step)
            evidence.append_journal(entry, self.last_hash, self.using)

        try:
            db.run_in_transaction(write, self.using)
        except budgets.BudgetExceeded as exc:
            self.step_failed(step, exc.code, str(exc))
        self.journaled(entry)
        return validation.copy_json(entry.output)

    def step_failed(self, step: Step, code: str, message: str) -> NoReturn:
        """Journal a final failure of the step and raise ``StepFailed`` into the workflow."""
        self.flush_pending()  # the failure chains to an earlier success, written first
        entry = self.new_entry(step, JournalEntry.State.FAILED, code=code, message=message)

        def write() -> None:
            self.fence(step.seq, reset_failures=True)
            evidence.append_journal(entry, self.last_hash, self.using)

        db.run_in_transaction(write, self.using)
        self.journaled(entry)
        raise StepFailed(code, message)

    # -- the deferred success ------------------------------------------------

    def flush_pending(self) -> None:
        """Commit a deferred success before anything else this run does."""
        pending = self.pending
        if pending is None:
            return
        try:
            if pending.ledger_kind is None:
                # Fence and journal entries in one statement, its own transaction.
                db.run_statement(
                    lambda: evidence.append_journal_fenced(
                        pending.entries,
                        self.last_hash,
                        self.using,
                        lease_ms=settings.lease_ms(),
                        reset=self.reset,
                    ),
                    self.using,
                )
            else:

                def write() -> None:
                    self.fence(pending.step.seq, reset_failures=True)
                    self.write_pending(pending)

                if not db.batches_statements(self.using) or not self._pending_batched(pending):
                    db.run_in_transaction(write, self.using)
        except (LeaseLost, RunCanceled):
            self.pending_lost(pending)
            raise
        self.pending_committed(pending)

    def _pending_batched(self, pending: Pending) -> bool:
        batch = Batch(self, pending.step.seq, reset_failures=True)
        batch.pending(pending)
        return batch.commit()

    def write_pending(self, pending: Pending) -> str:
        """Write a deferred success in the current fenced transaction; returns its hash."""
        if pending.ledger_kind:
            self.ledger(
                pending.step,
                pending.ledger_kind,
                output_hash=evidence.hash_value(pending.output),
            )
        prev = self.last_hash
        for entry in pending.entries:
            evidence.append_journal(entry, prev, self.using)
            prev = entry.entry_hash
        return prev

    def pending_committed(self, pending: Pending | None) -> None:
        """A transaction that carried the deferred success committed: apply it."""
        if pending is not None:
            self.pending = None
            for entry in pending.entries:
                self.journaled(entry)

    def pending_lost(self, pending: Pending | None) -> None:
        """The run was taken over or canceled before the deferred success committed.

        A PURE step's result is simply computed again; an external one's is
        evidence for the operator.
        """
        if pending is not None and pending.ledger_kind:
            self.late_evidence(
                pending.step,
                "result arrived after the run was taken over or canceled",
                output=pending.output,
                outcome=contradictions.SUCCEEDED,
            )

    # -- the ledger ----------------------------------------------------------

    def ledger_values(
        self, step: Step, kind: str, *, with_hashes: bool = False, **fields: Any
    ) -> dict[str, Any]:
        """The columns of a ledger entry of ``step`` (``with_hashes``: a dispatch's evidence)."""
        values: dict[str, Any] = dict(
            run_id=self.run_id,
            seq=step.seq,
            kind=kind,
            action_name=step.name,
            effect=step.action.effect.value,
            invocation_key=step.ctx.invocation_key or "",
            effect_key=step.ctx.effect_key,
            generation=self.generation,
        )
        if with_hashes:
            values.update(
                definition_hash=type(step.action).definition_hash(),
                input_hash=step.input_hash,
                preview_hash=evidence.hash_value(
                    {"action": step.name, "input": step.input_hash, **step.refs}
                ),
                principal_hash=evidence.hash_value(self.claim.principal),
                idempotency_key_hash=evidence.hash_optional(self.claim.run.idempotency_key),
                detail=self._dispatch_detail(step),
            )
        values.update(fields)
        if values.get("message"):
            values["message"] = redaction.scrub_error(values["message"])
        return values

    def _dispatch_detail(self, step: Step) -> dict[str, Any] | None:
        """A dispatch's refs, and the worker that calls the provider: a takeover asks
        whether it may still be inside the call (``holders.still_in_call``, #47)."""
        detail = {k: v for k, v in step.refs.items() if v}
        keeper = self.claim.keeper
        if keeper is not None and keeper.worker_id:
            detail["worker"] = keeper.worker_id
        return detail or None

    def ledger(self, step: Step, kind: str, *, with_hashes: bool = False, **fields: Any) -> None:
        """Append a ledger entry of ``step`` in the current (fenced) transaction."""
        values = self.ledger_values(step, kind, with_hashes=with_hashes, **fields)
        evidence.append_ledger(self.using, expect=self.ledger_head, **values)
        self.ledger_written(step, kind)

    def ledger_written(self, step: Step, kind: str, *, committed: bool = False) -> None:
        events.ledger_written(
            self.claim,
            self.using,
            seq=step.seq,
            kind=kind,
            effect=step.action.effect.value,
            effect_key=step.ctx.effect_key,
            committed=committed,
        )

    def ledger_event(self, step: Step, kind: str, *, message: str = "", fenced: bool) -> None:
        """A ledger entry in a transaction of its own."""

        def write() -> None:
            if fenced:
                self.fence(step.seq)
            self.ledger(step, kind, message=message)

        db.run_in_transaction(write, self.using)

    def late_evidence(
        self, step: Step, message: str, output: Any = None, outcome: str | None = None
    ) -> None:
        """A fenced-out worker's result is evidence, never applied as the step's result.

        ``outcome``: what the call answered ("succeeded", "failed"; None: no
        answer). One that contradicts the decision that closed the invocation
        meanwhile (a reconcile, an operator, another holder) names it, and puts
        a run not ended yet in the operators' queue (``contradictions.py``, #47).
        """

        def write() -> None:
            db.lock_run(self.using, self.run_id)
            said = contradictions.contradicted(
                self.using, self.run_id, step.seq, step.ctx.invocation_key or "", outcome
            )
            detail: dict[str, Any] = {}
            if output is not None:
                # Never the raw output: it may hold card tokens or credentials.
                detail["output"] = evidence.redacted_summary(output)
            if outcome is not None:
                detail["outcome"] = outcome
            if said is not None:
                detail["contradicts"] = said
            values = self.ledger_values(
                step,
                LedgerEntry.Kind.LATE_RESULT,
                message=message,
                output_hash=evidence.hash_value(output) if output is not None else "",
                detail=detail or None,
            )
            late = evidence.append_ledger(self.using, expect=self.ledger_head, **values)
            self.ledger_written(step, LedgerEntry.Kind.LATE_RESULT)
            if said is not None:
                logger.error(
                    "run %s step %s: the late result contradicts the %s entry %s (%s)",
                    self.run_id,
                    step.seq,
                    said["kind"],
                    said["entry"],
                    said["outcome"],
                )
                contradictions.raise_incident(self.using, self.run_id, step.seq, late.pk, said)

        try:
            db.run_in_transaction(write, self.using)
        except Exception:
            logger.exception(
                "run %s step %s: could not record late evidence", self.run_id, step.seq
            )

    def ledger_end(self) -> tuple[int, str | None]:
        """The ledger's length and head as this execution last wrote or read them."""
        head = self.ledger_head
        return head.count, head.head

    def written_chains(self) -> evidence.WrittenChains | None:
        """The run's chains as this execution verified (at its claim) and wrote them, or
        None unless it knows every entry's row version."""
        head = self.ledger_head
        versions = [evidence.row_version(self.entries[seq]) for seq in sorted(self.entries)]
        if head.versions is None or None in versions:
            return None
        loaded = self.loaded_anchors
        return evidence.WrittenChains(
            self.run_id,
            evidence.current_anchor(
                self.run_id, "journal", len(versions), self.last_hash, loaded["journal"]
            ),
            [v for v in versions if v],
            evidence.current_anchor(self.run_id, "ledger", head.count, head.head, loaded["ledger"]),
            head.versions,
        )


class Batch:
    """The writes of one transaction of a run, sent with BEGIN and COMMIT in one round
    trip (``db.commit_batch``) instead of a round trip each.

    Each write is a strict append (``evidence``): one that does not find the run
    and its chains as this execution believes fails, and the transaction with it.
    The first also fences the run, holding its row lock for the rest. Nothing is
    applied to the journal (ledger head, hashes, events) before the commit.
    ``commit()`` False: nothing was written (a chain moved by someone else; a
    conflict is retried by ``db.commit_batch``); the caller runs the same writes
    one statement at a time, which knows why and says so. A run that is not ours
    any more (canceled, ended, taken over) is the fence's error instead.
    """

    def __init__(
        self, journal: RunJournal, step: int | None = None, *, reset_failures: bool = False
    ) -> None:
        self.journal = journal
        self.fence: evidence.Fence | None = evidence.Fence(
            journal.generation, settings.lease_ms(), step, journal.reset if reset_failures else None
        )
        head = journal.ledger_head
        self.head = evidence.LedgerHead(head.count, head.head)
        self.last_hash = journal.last_hash
        self.statements: list[db.Statement] = []
        #: What each statement writes: a ledger entry, the journal entries of one
        #: append (``evidence.stored_all``), or None.
        self.entries: list[JournalEntry | LedgerEntry | list[JournalEntry] | None] = []
        self.written: list[tuple[Step, str]] = []

    def _fence(self) -> evidence.Fence | None:
        fence, self.fence = self.fence, None
        return fence

    def add(
        self,
        statement: db.Statement,
        entry: JournalEntry | LedgerEntry | list[JournalEntry] | None,
    ) -> None:
        """A statement that carries its own fence, such as the run's end; first."""
        self.fence = None
        self.statements.append(statement)
        self.entries.append(entry)

    def ledger(self, step: Step, kind: str, *, with_hashes: bool = False, **fields: Any) -> None:
        values = self.journal.ledger_values(step, kind, with_hashes=with_hashes, **fields)
        entry, statement = evidence.ledger_statement(
            self.journal.using, self.head, self._fence(), **values
        )
        self.statements.append(statement)
        self.entries.append(entry)
        self.written.append((step, kind))

    def journal_entry(self, entry: JournalEntry | list[JournalEntry]) -> None:
        """An append of one journal entry, or of several in one statement."""
        entries = entry if isinstance(entry, list) else [entry]
        self.statements.append(evidence.journal_statement(entries, self.last_hash, self._fence()))
        self.entries.append(entries)
        self.last_hash = entries[-1].entry_hash

    def pending(self, pending: Pending) -> None:
        """A deferred success, as ``RunJournal.write_pending`` writes it."""
        self.pending_ledger(pending)
        self.journal_entry(pending.entries)

    def pending_ledger(self, pending: Pending) -> None:
        if pending.ledger_kind:
            self.ledger(
                pending.step, pending.ledger_kind, output_hash=evidence.hash_value(pending.output)
            )

    def commit(self) -> bool:
        """Send it all with BEGIN and COMMIT; False when a guard refused it, the fence's
        error (``RunCanceled``, ``LeaseLost``) when that guard was the fence."""
        journal = self.journal
        try:
            rows = db.commit_batch(journal.using, self.statements)
        except db.BatchRefused as exc:
            # Refused by the fence (the run canceled, ended or taken over meanwhile): the
            # fence's error, not the same writes again for the database to refuse.
            lost = db.not_ours(journal.using, journal.run_id, journal.generation)
            if lost is not None:
                raise lost from None
            logger.info("run %s: batched writes refused (%s)", journal.run_id, exc)
            return False
        self.committed(rows)
        return True

    def committed(self, rows: list[tuple | None]) -> None:
        """The batch committed: its entries are stored, the ledger head moves past them."""
        journal = self.journal
        for entry, row in zip(self.entries, rows, strict=True):
            if isinstance(entry, list):
                if evidence.written_row(row) is not None:
                    evidence.stored_all(entry, journal.using, row)  # type: ignore[arg-type]
            elif entry is not None and row is not None:
                evidence.stored(entry, journal.using, row)
        for entry in self.entries:
            if isinstance(entry, LedgerEntry):
                journal.ledger_head.appended(entry)  # in order, as the batch's head moved
        for step, kind in self.written:
            journal.ledger_written(step, kind, committed=True)
