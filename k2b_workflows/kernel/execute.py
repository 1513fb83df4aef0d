"""Executing a claimed run: replay the journal, then run new steps per effect class.

One file answers "what happens after a crash in a step of class X":

- PURE: nothing happens before ``run()``; an exception is a retryable failure.
- TRANSACTIONAL: ``run()`` executes inside the atomic block (``ctx.tx``) that
  fenced the run row and commits the journal entry; an exception or a crash
  rolls both back, and the journal tells on replay whether it committed.
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
import copy
import functools
import logging
import threading
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.core.exceptions import PermissionDenied
from django.db import DatabaseError, transaction
from django.db.models import JSONField

from .. import redaction, signals, store, tracing, validation
from ..actions import (
    Action,
    Ambiguous,
    Effect,
    Failed,
    InvalidResult,
    Succeeded,
    Unknown,
    Waiting,
    as_action,
    canonical_json,
    missing_ref,
    to_json_value,
    validate_result,
)
from ..exceptions import InvalidInput, LeaseLost, RunCanceled, StepFailed, Suspend, UnknownWorkflow
from ..limits import RateLimit
from ..models import JournalEntry, LedgerEntry, WorkflowRun
from ..workflows import ChildResult, RunHandle, WorkflowDefinition, get_workflow
from . import (
    budgets,
    clock,
    db,
    events,
    evidence,
    flow,
    hooks,
    retrying,
    seals,
    waits,
    weather,
    witness,
)
from .context import StepContext, _holding

if TYPE_CHECKING:
    from ..retries import Retry
    from .leases import LeaseKeeper

logger = logging.getLogger("k2b_workflows")

CHILDREN_KIND = "k2b.children"
#: Journal entries named ``k2b.patch:<id>`` record that a run took a patch.
PATCH_KIND = "k2b.patch"
#: A workflow's traceback is kept for the operator up to this length (its end).
MAX_TRACEBACK_CHARS = 6000
# Ledger kinds that close an invocation of an effect: after one of these the
# next dispatch is a new invocation with a new key (and the same effect key).
_CLOSING = {
    LedgerEntry.Kind.SUCCEEDED,
    LedgerEntry.Kind.FAILED,
    LedgerEntry.Kind.RECONCILED,
    LedgerEntry.Kind.RESOLVED_CONFIRMED,
    LedgerEntry.Kind.RESOLVED_ABSENT,
    LedgerEntry.Kind.REJECTED,
}


class _Rollback(Exception):
    """Leave a TRANSACTIONAL step's atomic block without committing, carrying the result."""

    def __init__(self, result: Any) -> None:
        self.result = result


@dataclass
class _Denied:
    failed: Failed


@dataclass
class _EffectState:
    """What the ledger says about one step's external effect."""

    attempts: int = 0  # invocations dispatched so far
    open_key: str | None = None  # invocation dispatched with no known outcome
    polls: int = 0  # reconcile() answers "pending" since the last dispatch


@dataclass
class Preloaded:
    """What an execution needs to replay a run, read once."""

    run: WorkflowRun
    journal: list[JournalEntry]
    ledger: list[LedgerEntry]


#: A run's end when its last step is already journaled; fenced like every write.
_FINISH_TEMPLATE = """
UPDATE k2b_run
   SET status = 'succeeded', output = %s::jsonb, end_seal = %s, error_code = '',
       error_message = '', finished_at = k2b_now(), lease_expires_at = NULL,
       consecutive_failures = 0, updated_at = k2b_now()
 WHERE id = %s AND generation = %s AND status = 'running'{verified}
RETURNING id
"""
_FINISH_SQL = _FINISH_TEMPLATE.format(verified="")
#: The same, once it has found the run's chains as its execution wrote them.
_AS_WRITTEN_FINISH_SQL = _FINISH_TEMPLATE.format(verified=evidence.AS_WRITTEN_CHECK)

_PRELOAD_SQL = """
SELECT {run_columns},
       (SELECT json_agg(j ORDER BY j.seq) FROM {journal} j WHERE j.run_id = r.id),
       (SELECT json_agg(l ORDER BY l.id) FROM {ledger} l WHERE l.run_id = r.id)
  FROM k2b_run r
 WHERE {where}
"""
#: A claim's entries come with their row versions (``row_xmin``): verified at load,
#: they are what the run's end checks its chains against (``_end_as_written``).
_VERSIONED = "(SELECT t.*, t.xmin::text AS row_xmin FROM {table} t)"


def preload(using: str, run_ids: list[Any]) -> dict[Any, Preloaded]:
    """Read claimed runs with their journals and whole ledgers: one raw statement.

    Called inside the claim's transaction, so a claim and its reads cost one commit.
    A statement of its own, after the claim's: under READ COMMITTED it takes a
    new snapshot, so it sees every journal entry committed before our claim
    locked the row (a claim's own snapshot may predate a holder's last commit).
    Raw SQL because compiling three ORM queries per claim cost the claiming
    thread more than the round trips did.
    """
    if not run_ids:
        return {}
    return preloaded(using, db.fetch_statement(using, *preload_statement(run_ids)))


def preload_statement(run_ids: list[Any]) -> tuple[str, list[Any]]:
    """The statement of ``preload`` for these (one or more) run ids, and its parameters."""
    if len(run_ids) == 1:
        return preload_sql(single=True), list(run_ids)
    return preload_sql(), [list(run_ids)]


@functools.cache
def preload_sql(*, single: bool = False) -> str:
    """The statement of ``preload`` (built once); its one parameter is a list of run ids,
    or one run id with ``single``.

    Two statements, because a prepared ``id = ANY($1)`` is planned again at
    every execution (PostgreSQL prefers a plan for the array at hand to the
    generic one), and a run's end reads one run: ``id = $1`` is planned once.
    """
    run_fields = WorkflowRun._meta.concrete_fields
    return _PRELOAD_SQL.format(
        run_columns=", ".join(f"r.{f.column}" for f in run_fields),
        journal=_VERSIONED.format(table="k2b_journal"),
        ledger=_VERSIONED.format(table="k2b_ledger"),
        where="r.id = %s" if single else "r.id = ANY(%s)",
    )


def preloaded(using: str, rows: list[tuple]) -> dict[Any, Preloaded]:
    """Runs, journals and ledgers from the rows of ``preload_sql``."""
    run_fields = WorkflowRun._meta.concrete_fields
    loaded: dict[Any, Preloaded] = {}
    for row in rows:
        values = [
            db.from_json(v) if isinstance(f, JSONField) else v
            for f, v in zip(run_fields, row, strict=False)
        ]
        run = WorkflowRun.from_db(using, [f.attname for f in run_fields], values)
        loaded[run.pk] = _with_entries(using, run, row)
    return loaded


#: What a verification of a run's chains reads (``chains_sql``): the run's anchors.
_CHAINS_FIELDS = ["id", "journal_anchor", "ledger_anchor"]


@functools.cache
def chains_sql() -> str:
    """``preload_sql(single=True)`` for a verification of the chains: of the run row
    only its id and anchors, where a claim reads and decodes every column."""
    return _PRELOAD_SQL.format(
        run_columns=", ".join(f"r.{column}" for column in _CHAINS_FIELDS),
        journal="k2b_journal",
        ledger="k2b_ledger",
        where="r.id = %s",
    )


def chains_read(using: str, rows: list[tuple]) -> dict[Any, Preloaded]:
    """Runs (id and anchors only), journals and ledgers from the rows of ``chains_sql``.

    The entries are ``evidence.StoredEntry`` objects, not model instances: they are
    only verified, never replayed, and a model instance (each field through
    ``to_python``, timestamps parsed) cost about 8 µs per entry, where this costs
    a fraction of one; a three-step EXTERNAL run's end reads seven entries.
    """
    loaded: dict[Any, Preloaded] = {}
    for row in rows:
        run = WorkflowRun.from_db(using, _CHAINS_FIELDS, row[: len(_CHAINS_FIELDS)])
        journal = [evidence.StoredEntry(e) for e in db.from_json(row[-2]) or ()]
        ledger = [evidence.StoredEntry(e) for e in db.from_json(row[-1]) or ()]
        loaded[run.pk] = Preloaded(run, journal, ledger)  # type: ignore[arg-type]
    return loaded


def _with_entries(using: str, run: WorkflowRun, row: tuple) -> Preloaded:
    """The run with its journal and ledger, the row's last two columns."""
    journal = [_from_json_row(JournalEntry, using, e) for e in db.from_json(row[-2]) or ()]
    ledger = [_from_json_row(LedgerEntry, using, e) for e in db.from_json(row[-1]) or ()]
    return Preloaded(run, journal, ledger)


def _from_json_row(model: Any, using: str, data: dict[str, Any]) -> Any:
    """A model instance from ``row_to_json`` output (timestamps and UUIDs arrive as text),
    with its row version (``evidence.row_version``) when the row carried it."""
    fields = model._meta.concrete_fields
    values = [
        data[f.column] if isinstance(f, JSONField) else f.to_python(data[f.column]) for f in fields
    ]
    instance = model.from_db(using, [f.attname for f in fields], values)
    if "row_xmin" in data:
        evidence.keep_row_version(instance, data["row_xmin"])
    return instance


class Execution:
    """One claim of one run: replays it and executes steps until it stops, parks or ends."""

    def __init__(
        self,
        run_id: Any,
        generation: int,
        *,
        using: str | None = None,
        keeper: LeaseKeeper | None = None,
        preloaded: Preloaded | None = None,
    ) -> None:
        self.run_id = run_id
        self.generation = generation
        self.using = using or store.database()
        self.keeper = keeper
        self.canceled = threading.Event()
        self.next_seq = 0
        self.steps_executed = 0
        self.outcome = "dropped"
        #: Set by a worker shutting down: stop before the next step and release the run.
        self.stop_requested: threading.Event | None = None
        #: The run's row, journal and ledger, read in the claim's transaction.
        self.preloaded = preloaded
        #: A step's success not committed yet: it commits with the next write of
        #: this run (the next step's first transaction, or the run's end), see
        #: ``_journal_success``.
        self._pending: _Pending | None = None
        #: Where the run's ledger chain ends, as far as this execution knows (a hint
        #: that saves the append a read; the append checks it).
        self.ledger_head: evidence.LedgerHead | None = None
        #: The run could not be released after a lost connection: the worker must.
        self.release_pending = False
        #: This claim's ``k2b.run`` span (``tracing.py``); None when nothing traces.
        self.trace: tracing.RunTrace | None = None
        #: The retry policy of the step being executed (``retries.Retry``), if any.
        self.retry_policy: Retry | None = None

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
            return "dropped"
        run = loaded.run
        self._load(loaded)
        self.run = run
        self.root_id = run.root_id or run.id
        self.app_id = run.app_id
        self.principal = copy.deepcopy(run.principal)
        events.run_claimed(self)
        if self.keeper:
            self.keeper.track(self.run_id, self.generation, self.canceled)
        if tracing.ENABLED:
            self.trace = tracing.run_started(self)
        try:
            # Before anything replays the journal or trusts the ledger (#9): a tampered,
            # truncated or wiped chain stops the run here, with nothing executed.
            self._verify_loaded(loaded)
            try:
                self.definition: WorkflowDefinition = get_workflow(
                    run.workflow_name, run.workflow_version
                )
            except UnknownWorkflow as exc:
                if _has_other_versions(run.workflow_name):
                    # Another process may hold this version's code (a rolling deploy):
                    # hand the run back rather than fail or replay it on other code.
                    from .claim import release

                    logger.warning("run %s: %s; released", self.run_id, exc)
                    release(self.using, self.run_id, self.generation)
                    self.outcome = "no_code"
                    return self.outcome
                self._fail_run(
                    "UNKNOWN_WORKFLOW", f"no workflow {run.workflow_name!r} is registered"
                )
                return self.outcome
            if run.consecutive_failures >= retrying.claim_bound(self.definition):
                self._exhausted(run.consecutive_failures, run.error_message)
            self._run_workflow()
        except Suspend:
            pass
        except (LeaseLost, RunCanceled) as exc:
            logger.info("run %s: stopped: %s", self.run_id, exc)
            self.outcome = "canceled" if isinstance(exc, RunCanceled) else "lease_lost"
        except db.CommitOutcomeUnknown as exc:
            # Drop what we believe: the next claim re-reads the journal, which
            # committed (or not) in the very transaction whose outcome we lost.
            logger.warning(
                "run %s: commit outcome unknown (%s); re-reading later", self.run_id, exc
            )
            self.outcome = "commit_unknown"
            self._release_after_unknown_commit()
        except DatabaseError as exc:
            if not weather.is_connection_error(exc):
                raise
            with contextlib.suppress(Suspend):
                self._lost_connection(exc)
        finally:
            if self.keeper:
                self.keeper.untrack(self.run_id)
            if self.trace is not None:
                self.trace.end(self.outcome)
        return self.outcome

    def _verify_loaded(self, loaded: Preloaded) -> None:
        """Stop the run in ``needs_attention`` if its chains or anchors do not verify (#9).

        A claim's preload reads under the claim's row lock. Without one (no
        preload given), an entry may commit between the reads of the row and of
        the entries: a break is confirmed on a locked re-read before it counts.
        """
        sealed = seals.start_problem(loaded.run)
        if sealed is not None:
            # Nothing of the row's start fields may reach a step: not even a retry
            # of its lock, since no later read can make a changed input the original.
            logger.error("run %s: integrity: %s", self.run_id, sealed)
            self._needs_attention(store.INTEGRITY_CHAIN_BROKEN, sealed, step=None)
        broken = evidence.verify_run(loaded.run, loaded.journal, loaded.ledger)
        if broken is not None and self.preloaded is None:
            with transaction.atomic(using=self.using):
                db.lock_run(self.using, self.run_id)
                again = preload(self.using, [self.run_id])[self.run_id]
            if again.run.generation != self.generation or again.run.status != "running":
                raise Suspend  # taken over or canceled meanwhile: outcome "dropped"
            broken = evidence.verify_run(again.run, again.journal, again.ledger)
            if broken is None:
                self._load(again)
                self.run = again.run
        if broken is not None:
            logger.error("run %s: integrity chain broken: %s", self.run_id, broken)
            self._needs_attention(store.INTEGRITY_CHAIN_BROKEN, str(broken), step=None)

    def _load(self, loaded: Preloaded) -> None:
        entries = loaded.journal
        self.journal = {e.seq: e for e in entries}
        #: Each chain's entry count and the run row's anchor over it, as claimed.
        self._loaded_anchors = {
            "journal": (len(entries), loaded.run.journal_anchor),
            "ledger": (len(loaded.ledger), loaded.run.ledger_anchor),
        }
        self.ledger_head = evidence.LedgerHead.loaded(loaded.ledger)
        self.last_hash = entries[-1].entry_hash if entries else evidence.GENESIS
        self.effects: dict[int, _EffectState] = {}
        for entry in loaded.ledger:
            if entry.seq is None or entry.seq in self.journal:
                continue
            state = self.effects.setdefault(entry.seq, _EffectState())
            if entry.kind == LedgerEntry.Kind.DISPATCHED:
                state.attempts += 1
                state.open_key = entry.invocation_key
                state.polls = 0
            elif entry.kind == LedgerEntry.Kind.PENDING:
                state.polls += 1
            elif entry.kind in _CLOSING:
                state.open_key = None

    def _run_workflow(self) -> None:
        handle = RunHandle(self)
        try:
            output = self.definition.fn(handle, copy.deepcopy(self.run.input))
        except StepFailed as exc:
            self._fail_run(exc.code, exc.message)
            return
        except (Suspend, LeaseLost, RunCanceled, db.CommitOutcomeUnknown):
            raise
        except DatabaseError as exc:
            # The kernel's own writes inside run.step: weather, not the workflow's bug.
            self._retry_later(f"database error: {exc}")
            return
        except Exception as exc:
            if weather.is_connection_error(exc):
                raise  # the database's weather, not the workflow's failure
            # Step errors never get here (``step`` turns them into retries): this is
            # the workflow function's own bug. Retrying the same code replays to the
            # same line, so one traceback and an operator, not five and backoff.
            logger.exception("run %s: workflow code raised", self.run_id)
            self._code_error(exc)
            return
        try:
            output = to_json_value(output, "the workflow's return value")
        except InvalidInput as exc:
            self._fail_run(store.INVALID_WORKFLOW_OUTPUT, str(exc))
            return
        self._succeed_run(output)

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
        stopping = self.stop_requested is not None and self.stop_requested.is_set()
        if stopping or self.next_seq in self.journal or not self._carries_pending(action):
            self._flush_pending()
        # else the step's own first transaction commits the deferred success: an
        # external step's dispatch, a transactional step's atomic block.
        self._check_shutdown()
        self.retry_policy = None
        seq = self.next_seq
        self.next_seq += 1
        name = action.action_name()
        try:
            # Step inputs are hashed, never stored: NUL and size are no concern here.
            input = to_json_value(input, f"input of step {seq} ({name})", stored=False)
        except InvalidInput as exc:
            self._fail_run(store.INVALID_STEP_INPUT, str(exc))
        input_hash = evidence.hash_value(input)
        entry = self.journal.get(seq)
        if entry is not None:
            return self._replay(entry, name, input, input_hash)
        self._check_parked_step(seq, name, input_hash)
        if self.trace is not None:
            return self.trace.step(
                seq,
                action,
                input_hash,
                lambda: self._executed(
                    seq, action, name, input, input_hash, approval_ref, backup_ref
                ),
            )
        return self._executed(seq, action, name, input, input_hash, approval_ref, backup_ref)

    def _executed(
        self,
        seq: int,
        action: Action,
        name: str,
        input: Any,
        input_hash: str,
        approval_ref: str | None,
        backup_ref: str | None,
    ) -> Any:
        """A new step, its errors turned into the run's retry, failure or suspension."""
        try:
            return self._new_step(seq, action, name, input, input_hash, approval_ref, backup_ref)
        except (StepFailed, LeaseLost, RunCanceled, db.CommitOutcomeUnknown):
            raise
        except DatabaseError as exc:
            if weather.is_connection_error(exc):
                self._lost_connection(exc)
            self._retry_later(f"step {seq} ({name}): database error: {exc}")
        except Exception as exc:
            if weather.is_connection_error(exc):
                self._lost_connection(exc)
            # An action's hook raised (PURE, IDEMPOTENT): retryable. Handled here so
            # that it can never be mistaken for the workflow's own bug, nor be
            # swallowed by the workflow's ``except Exception``.
            self._retry_later(f"step {seq} ({name}) raised {type(exc).__name__}: {exc}")
        raise AssertionError("unreachable")

    def _carries_pending(self, action: Action) -> bool:
        """Whether a new step of ``action`` writes the deferred success itself, in its
        first transaction: an EXTERNAL step's dispatch always; a TRANSACTIONAL
        step's block when the success has no ledger entry, its fenced append then
        being the fence the block takes before ``run()``."""
        if action.effect.is_external:
            return True
        pending = self._pending
        return (
            action.effect == Effect.TRANSACTIONAL
            and pending is not None
            and pending.ledger_kind is None
        )

    def _new_step(
        self,
        seq: int,
        action: Action,
        name: str,
        input: Any,
        input_hash: str,
        approval_ref: str | None,
        backup_ref: str | None,
    ) -> Any:
        ctx = StepContext(self, seq)
        started = clock.now()
        step = _Step(seq, action, name, input, input_hash, started, ctx)
        self.retry_policy = retrying.policy_for(action, self.definition)
        if self.run.consecutive_failures >= retrying.max_attempts(self.retry_policy):
            # Crashes in this step counted at the claims: past its own bound.
            self._exhausted(self.run.consecutive_failures, self.run.error_message)
        if seq >= self.definition.max_steps:
            return self._step_failed(
                step,
                store.MAX_STEPS_EXCEEDED,
                f"step {seq} is past max_steps={self.definition.max_steps}",
            )
        effect = action.effect
        refused = missing_ref(action, approval_ref, backup_ref)
        if refused is not None:
            return self._step_failed(step, *refused)
        step.refs = {"approval_ref": approval_ref, "backup_ref": backup_ref}
        try:
            step.cost = budgets.validate_cost(action.cost(input)) if action.defines("cost") else {}
        except Exception as exc:
            self._retry_later(f"step {seq} ({name}): cost() raised {exc!r}")
        if action.rate_limit is not None:
            self._admit_dispatch(step, action.rate_limit)
        self.steps_executed += 1
        if effect.is_external:
            return self._external(step)
        if effect == Effect.TRANSACTIONAL:
            return self._transactional(step)
        return self._pure_or_idempotent(step)

    def _admit_dispatch(self, step: _Step, limit: RateLimit) -> None:
        """Count this dispatch against the action's rate limit, or defer the run (``flow.py``).

        Its own commit, before the budget charge and the effect: a crash after
        it counts a dispatch that may have happened, never one too few. A full
        window re-queues the run for the instant it frees: no failure counted,
        the thread freed, nothing charged yet.
        """
        try:
            key = flow.limit_key(step.action, step.input)
        except InvalidInput as exc:
            self._fail_run(store.INVALID_RATE_LIMIT_KEY, f"step {step.seq} ({step.name}): {exc}")
        self._flush_pending()

        def admit() -> tuple[int | None, Any]:
            self._fence(step.seq)
            reserved, until = flow.admit_dispatch(
                self.using, key, limit, self.run_id, step.seq, self.generation
            )
            if until is not None:
                flow.defer(self.using, self.run_id, self.generation, until, key)
            return reserved, until

        reserved, until = db.run_in_transaction(admit, self.using)
        if until is None:
            step.rate_dispatch = reserved
            return
        self.outcome = "deferred"
        events.run_changed(self, "deferred", step.seq, reason=f"rate limit of {key} full")
        raise Suspend

    def _fence(self, step: int | None = None, *, reset_failures: bool = False) -> None:
        """Lock our run row in the current transaction and check we still own it."""
        db.fence(
            self.using,
            self.run_id,
            self.generation,
            store.lease_ms(),
            step,
            reset_failures=reset_failures,
        )

    def _charge(self, step: _Step) -> None:
        """Charge the step's cost to the root's budget, in the current transaction, once."""
        budgets.charge(
            self.using, root_id=self.root_id, run_id=self.run_id, seq=step.seq, cost=step.cost
        )

    def _check_shutdown(self) -> None:
        if self.stop_requested is not None and self.stop_requested.is_set():
            from .claim import release

            release(self.using, self.run_id, self.generation)
            self.outcome = "released"
            events.run_changed(self, "released")
            raise Suspend

    def _replay(self, entry: JournalEntry, name: str, input: Any, input_hash: str) -> Any:
        if entry.action_name != name or not evidence.same_input(
            entry.input_hash, input, input_hash
        ):
            self._diverged(entry, name, input_hash)
        if entry.state == JournalEntry.State.SUCCEEDED:
            return copy.deepcopy(entry.output)
        raise StepFailed(entry.error_code, entry.error_message)

    def _diverged(self, entry: JournalEntry, name: str, input_hash: str) -> None:
        """The code asks for another step than the journal holds: stop before any effect.

        Raises ``Suspend`` (not an Exception) so that a workflow's ``except
        Exception`` cannot swallow it. Both sides are kept for the run page, as
        names and hashes only: never the inputs themselves.
        """
        seq = entry.seq
        if entry.action_name != name:
            message = f"step {seq} was {entry.action_name!r} when journaled, now {name!r}"
        else:
            message = f"step {seq} ({name}) was journaled with another input (hash differs)"
        marker = f"{PATCH_KIND}:"
        if entry.action_name.startswith(marker) and not name.startswith(marker):
            patch_id = entry.action_name[len(marker) :]
            message += (
                f"; the run took patch {patch_id!r} here: keep run.patched({patch_id!r}) or"
                f" run.deprecate_patch({patch_id!r}) at this point"
            )
        detail = {
            "kind": "nondeterminism",
            "seq": seq,
            "journaled": {
                "action": entry.action_name,
                "effect": entry.effect,
                "state": entry.state,
                "input_hash": entry.input_hash,
            },
            "asked": {"action": name, "input_hash": input_hash},
            "workflow_version": self.definition.version,
        }
        self._needs_attention(store.WORKFLOW_NONDETERMINISTIC, message, step=None, detail=detail)

    def _check_parked_step(self, seq: int, name: str, input_hash: str) -> None:
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
        detail = {
            "kind": "nondeterminism",
            "seq": seq,
            "parked": {"action": parked},
            "asked": {"action": name, "input_hash": input_hash},
            "workflow_version": self.definition.version,
        }
        message = (
            f"step {seq} was {parked!r} when the run parked there, now {name!r}: put the "
            "change behind run.patched(...) or start a new version"
        )
        self._needs_attention(store.WORKFLOW_NONDETERMINISTIC, message, step=None, detail=detail)

    def _code_error(self, exc: Exception) -> None:
        # Credentials in URLs and key=value pairs are removed, as from every stored text.
        text = redaction.redact_text("".join(traceback.format_exception(exc)))
        if len(text) > MAX_TRACEBACK_CHARS:
            text = "… (truncated)\n" + text[-MAX_TRACEBACK_CHARS:]
        self._needs_attention(
            store.WORKFLOW_CODE_ERROR,
            f"workflow code raised {type(exc).__name__}: {exc}"[:1000],
            step=None,
            detail={
                "kind": "code_error",
                "exception": type(exc).__name__,
                "traceback": text,
                "workflow_version": self.definition.version,
            },
        )

    # -- run.patched -----------------------------------------------------------

    def patched(self, patch_id: str) -> bool:
        """``run.patched``: True for a run at this point under the new code, journaled."""
        if not isinstance(patch_id, str) or not patch_id:
            raise InvalidInput("patched() takes a non-empty patch id")
        self._flush_pending()
        self._check_shutdown()
        seq = self.next_seq
        marker = f"{PATCH_KIND}:{patch_id}"
        entry = self.journal.get(seq)
        if entry is not None:
            if entry.action_name == marker:
                self.next_seq += 1
                return True
            if entry.action_name.startswith(f"{PATCH_KIND}:"):
                self._diverged(entry, marker, entry.input_hash)
            return False  # the journal shows a step of the old code at this point
        if self._started_before(seq):
            return False  # step ``seq`` began under the old code (an effect, a wait)
        self.next_seq += 1
        step = _Step(
            seq,
            _PatchAction(),
            marker,
            None,
            evidence.hash_value(None),
            clock.now(),
            StepContext(self, seq),
        )
        self._journal_success(step, Succeeded(True, summary=f"took patch {patch_id}"))
        return True

    def deprecate_patch(self, patch_id: str) -> None:
        """``run.deprecate_patch``: consume the marker where the run has one; journal nothing."""
        if not isinstance(patch_id, str) or not patch_id:
            raise InvalidInput("deprecate_patch() takes a non-empty patch id")
        entry = self.journal.get(self.next_seq)
        if entry is not None and entry.action_name == f"{PATCH_KIND}:{patch_id}":
            self.next_seq += 1

    def _started_before(self, seq: int) -> bool:
        """Did step ``seq`` leave a trace before this claim: ledger, charge, wait, child, AI task?

        Such a run met this point under the old code; taking a new branch now
        could skip an effect the old step may already have caused.
        """
        if seq in self.effects or seq in (self.run.current_step, self.run.wait_step):
            return True
        rows = db.fetchall(
            self.using,
            """SELECT EXISTS (SELECT 1 FROM k2b_budget_charge WHERE run_id = %s AND seq = %s)
                   OR EXISTS (SELECT 1 FROM k2b_ai_task WHERE run_id = %s AND seq = %s)
                   OR EXISTS (SELECT 1 FROM k2b_run WHERE parent_id = %s AND parent_step = %s)""",
            [self.run_id, seq] * 3,
        )
        return bool(rows[0][0])

    # -- markers: steps of the kernel's own (timers) ----------------------------

    def sleep(self, duration: Any = None, until: Any = None) -> None:
        """``run.sleep`` / ``run.sleep_until``: a durable timer (``timers.py``)."""
        from . import timers

        timers.sleep(self, duration=duration, until=until)

    def begin_marker(self) -> int:
        """Take the next position for a kernel step, after the previous step's success."""
        self._flush_pending()
        self._check_shutdown()
        self.retry_policy = None
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def replay_marker(self, entry: JournalEntry, name: str, input: Any, input_hash: str) -> Any:
        """A journaled kernel step: its output, or a nondeterminism incident."""
        return self._replay(entry, name, input, input_hash)

    def marker_step(
        self, seq: int, action: Action, name: str, input: Any, input_hash: str
    ) -> _Step:
        return _Step(seq, action, name, input, input_hash, clock.now(), StepContext(self, seq))

    def journal_marker(self, step: _Step, result: Succeeded) -> Any:
        return self._journal_success(step, result)

    def park_marker(self, seq: int, name: str, dependency: Any) -> None:
        self._park(seq, name, dependency)

    # -- PURE and IDEMPOTENT -------------------------------------------------

    def _pure_or_idempotent(self, step: _Step) -> Any:
        idempotent = step.action.effect == Effect.IDEMPOTENT
        denial = self._authorize_outside_tx(step)
        if denial is not None:
            return self._step_failed(step, denial.code or store.FORBIDDEN, denial.message)
        # After authorize, as for EXTERNAL: a refused step spends nothing.
        if idempotent and step.cost:
            self._charge_before_dispatch(step)
        allowed = (
            (Succeeded, Failed, Waiting, Ambiguous) if idempotent else (Succeeded, Failed, Waiting)
        )
        try:
            result = self._call(step, "run", allowed)
        except InvalidResult as exc:
            if idempotent:  # repeating with the same effect_key is safe
                self._retry_later(f"step {step.seq} ({step.name}): {exc}")
            self._fail_run(
                store.INVALID_ACTION_RESULT, f"step {step.seq} ({step.name}): {exc}", step=step
            )
        if isinstance(result, Ambiguous):
            self._retry_later(f"step {step.seq} ({step.name}) ambiguous: {result.message or ''}")
        if isinstance(result, Succeeded) and not idempotent and step.cost:
            # PURE steps have no effect to protect: charge with the journal entry.
            return self._journal_success(step, result, charge=True)
        return self._apply(step, result)

    # -- TRANSACTIONAL -------------------------------------------------------

    def _transactional(self, step: _Step) -> Any:
        for attempt in range(3):
            try:
                return self._transactional_once(step)
            except _Rollback as rb:
                result = rb.result
                if isinstance(result, InvalidResult):
                    self._fail_run(
                        store.INVALID_ACTION_RESULT,
                        f"step {step.seq} ({step.name}): {result}",
                        step=step,
                    )
                if isinstance(result, budgets.BudgetExceeded):
                    return self._step_failed(step, store.EFFECT_BUDGET_EXCEEDED, str(result))
                if isinstance(result, _Denied):
                    return self._step_failed(
                        step, result.failed.code or store.FORBIDDEN, result.failed.message
                    )
                return self._apply(step, result)
            except (LeaseLost, RunCanceled, db.CommitOutcomeUnknown, Suspend):
                raise
            except DatabaseError as exc:
                if weather.is_connection_error(exc):
                    raise
                if db.is_conflict(exc) and attempt < 2:
                    logger.info("run %s step %s: conflict, retrying", self.run_id, step.seq)
                    continue
                self._retry_later(f"step {step.seq} ({step.name}): database error: {exc}")
            except Exception as exc:
                self._retry_later(
                    f"step {step.seq} ({step.name}) raised {type(exc).__name__}: {exc}"
                )
        raise AssertionError("unreachable")

    def _transactional_once(self, step: _Step) -> Any:
        try:
            return self._transactional_block(step)
        except db.BatchRefused:
            # The journal write found the run not ours: the block rolled back.
            raise db.lease_lost(self.using, self.run_id, self.generation) from None

    def _transactional_block(self, step: _Step) -> Any:
        pending = self._pending
        prev = self.last_hash
        with db.atomic(self.using) as block, _holding():
            step.ctx.tx = block
            if pending is None:
                self._fence(step.seq)
            else:
                # The previous step's deferred success (PURE or IDEMPOTENT: no ledger
                # entry, see ``_carries_pending``) in the statement that fences: it
                # commits with this step, or rolls back with it and stays deferred.
                evidence.append_journal_fenced(
                    pending.entry, prev, self.using, lease_ms=store.lease_ms()
                )
                prev = pending.entry.entry_hash
            if step.cost:
                try:
                    self._charge(step)
                except budgets.BudgetExceeded as exc:
                    raise _Rollback(exc) from None
            try:
                denial = self._authorize(step)
                if denial is not None:
                    raise _Rollback(_Denied(denial))
                result = self._call(step, "run", (Succeeded, Failed, Waiting))
            except InvalidResult as exc:
                raise _Rollback(exc) from None
            if not isinstance(result, Succeeded):
                raise _Rollback(result)
            # The action may have run for long: fence again, extending the lease, in
            # the statement that journals the step, and COMMIT with it.
            entry = self._new_entry(step, JournalEntry.State.SUCCEEDED, result)
            if db.ends_in_atomic(self.using):
                sql, params = evidence.fenced_journal_statement(
                    entry, prev, lease_ms=store.lease_ms(), strict=True
                )
                row = db.commit_in_atomic(self.using, sql, params)
                evidence.fenced_journal_written(entry, self.using, row)
            else:
                evidence.append_journal_fenced(entry, prev, self.using, lease_ms=store.lease_ms())
        step.ctx.tx = None
        if pending is not None:
            self._pending = None
            self._journaled(pending.entry)
        self._journaled(entry)
        return copy.deepcopy(entry.output)

    # -- EXTERNAL, IRREVERSIBLE, SNAPSHOT_RESTORE ----------------------------

    def _external(self, step: _Step) -> Any:
        """A new external step. The previous step's deferred success, if any, is not
        flushed yet (see ``step``): it commits in the dispatch's transaction, before
        the provider is called; every other way out of here flushes it first."""
        state = self.effects.setdefault(step.seq, _EffectState())
        if state.open_key:
            # Dispatched before (a crash, an exception, a late result): never run
            # it again blindly. Ask the provider, or an operator.
            self._flush_pending()
            step.ctx.invocation_key = state.open_key
            return self._reconcile(step, state)
        denial = self._authorize_outside_tx(step)
        if denial is not None:
            self._flush_pending()
            self._ledger_event(step, LedgerEntry.Kind.REJECTED, message=denial.message, fenced=True)
            return self._step_failed(step, denial.code or store.FORBIDDEN, denial.message)
        invocation_key = f"{step.ctx.effect_key}:{state.attempts + 1}"
        step.ctx.invocation_key = invocation_key
        pending = self._pending

        def dispatch() -> None:
            self._fence(step.seq, reset_failures=pending is not None)
            if pending is not None:
                self._write_pending(pending)
            if step.cost:
                self._charge(step)
            self._ledger(step, LedgerEntry.Kind.DISPATCHED, with_hashes=True)

        def dispatch_batched() -> bool:
            if step.cost or not db.batches_statements(self.using):
                return False
            batch = _Batch(self, step.seq, reset_failures=pending is not None)
            if pending is not None:
                batch.pending(pending)
            batch.ledger(step, LedgerEntry.Kind.DISPATCHED, with_hashes=True)
            return batch.commit()

        try:
            if not dispatch_batched():
                db.run_in_transaction(dispatch, self.using)
        except budgets.BudgetExceeded as exc:
            self._flush_pending()  # rolled back with the dispatch: written now, alone
            self._ledger_event(step, LedgerEntry.Kind.REJECTED, message=str(exc), fenced=True)
            return self._step_failed(step, store.EFFECT_BUDGET_EXCEEDED, str(exc))
        except (LeaseLost, RunCanceled):
            self._pending_lost(pending)
            raise
        except db.CommitOutcomeUnknown:
            self._close_unsent_dispatch(step, invocation_key)
            raise
        if pending is not None:
            self._pending = None
            self._journaled(pending.entry)
        state.attempts += 1
        state.open_key = invocation_key
        # Told outside the database before the provider is: a database restored to a
        # moment before this commit no longer holds it, and the witness says so.
        witness.dispatched(self.run_id, step.seq, self.generation, *self._ledger_end())

        try:
            result = self._call(step, "run", (Succeeded, Failed, Ambiguous))
        except (LeaseLost, RunCanceled) as exc:
            self._late_evidence(step, f"run() stopped: {exc}")
            raise
        except InvalidResult as exc:
            result = Ambiguous(f"invalid result after dispatch: {exc}")
        except Suspend:
            raise
        except Exception as exc:
            result = Ambiguous(f"run() raised after dispatch: {type(exc).__name__}: {exc}")

        if isinstance(result, Ambiguous):
            self._ledger_event(
                step, LedgerEntry.Kind.OUTCOME_UNKNOWN, message=result.message or "", fenced=True
            )
            return self._reconcile(step, state)
        if isinstance(result, Succeeded):
            return self._journal_success(step, result, ledger_kind=LedgerEntry.Kind.SUCCEEDED)
        return self._external_failed(step, result, LedgerEntry.Kind.FAILED)

    def _close_unsent_dispatch(self, step: _Step, invocation_key: str) -> None:
        """The dispatch's COMMIT lost its answer: it may have committed, but run() was not called.

        This process knows what no replay could: if the dispatch is in the ledger,
        close that invocation as never sent, so the replay dispatches anew instead
        of treating it as doubted. Without our lease nothing is written, and the
        replay reconciles as after any crash.
        """
        from django.db import connections

        connections[self.using].close()

        def close() -> None:
            self._fence(step.seq)
            if (
                LedgerEntry.objects.using(self.using)
                .filter(
                    run_id=self.run_id,
                    invocation_key=invocation_key,
                    kind=LedgerEntry.Kind.DISPATCHED,
                )
                .exists()
            ):
                self._ledger(
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

    def _reconcile(self, step: _Step, state: _EffectState) -> Any:
        if not step.action.defines("reconcile"):
            self._ledger_event(
                step,
                LedgerEntry.Kind.RECONCILE_UNKNOWN,
                message="the action has no reconcile()",
                fenced=True,
            )
            self._needs_attention(
                store.EFFECT_OUTCOME_UNKNOWN,
                f"step {step.seq} ({step.name}): outcome unknown and no reconcile()",
                step=step.seq,
            )
        try:
            result = self._call(step, "reconcile", (Succeeded, Failed, Unknown, Waiting))
        except (LeaseLost, RunCanceled, Suspend):
            raise
        except InvalidResult as exc:
            result = Unknown(f"reconcile() returned an invalid result: {exc}")
        except Exception as exc:
            if weather.is_connection_error(exc):
                raise  # a lookup that could not reach our database tells nothing: ask again later
            result = Unknown(f"reconcile() raised {type(exc).__name__}: {exc}")
        events.reconcile_answered(
            self, step.seq, step.ctx.effect_key, type(result).__name__.lower()
        )
        if isinstance(result, Succeeded):
            return self._journal_success(step, result, ledger_kind=LedgerEntry.Kind.RECONCILED)
        if isinstance(result, Waiting) and state.polls >= store.max_reconcile_polls():
            # A provider that stays "pending" would be polled forever, a ledger
            # row and a generation each time: past the bound, an operator decides.
            result = Unknown(f"still pending after {state.polls} polls (MAX_RECONCILE_POLLS)")
        if isinstance(result, Waiting):
            # Still pending at the provider: poll again on a wake or at the deadline,
            # each poll a new ledger operation under the same effect key.
            dep = result.dependency
            self._park(
                step.seq,
                step.name,
                dep,
                pending=(step, f"pending: waiting on {dep.kind}/{dep.key}"),
            )
        if isinstance(result, Failed):
            # The provider says it did not happen. Still no automatic re-run: a
            # lookup can lag behind the provider's own writes, and the contract
            # is that only an operator's "effect absent" runs a doubted step again.
            return self._external_failed(step, result, LedgerEntry.Kind.RECONCILED, may_retry=False)
        self._ledger_event(
            step, LedgerEntry.Kind.RECONCILE_UNKNOWN, message=result.message or "", fenced=True
        )
        self._needs_attention(
            store.EFFECT_OUTCOME_UNKNOWN,
            f"step {step.seq} ({step.name}): reconcile() cannot tell: {result.message or ''}",
            step=step.seq,
        )
        raise AssertionError("unreachable")

    def _external_failed(
        self, step: _Step, result: Failed, kind: str, *, may_retry: bool = True
    ) -> Any:
        """The provider says the effect did not happen.

        A retryable failure answered by ``run()`` itself is a clean answer: the
        step runs again later under a new invocation key. After doubt
        (``may_retry=False``) the step fails instead.
        """
        state = self.effects[step.seq]

        def record() -> None:
            self._fence(step.seq)
            self._ledger(
                step,
                kind,
                message=result.message,
                detail={"outcome": "failed", "code": result.code, "retryable": result.retryable},
            )

        try:
            db.run_in_transaction(record, self.using)
        except (LeaseLost, RunCanceled):
            self._late_evidence(step, f"failed result after losing the run: {result.message}")
            raise
        state.open_key = None
        if result.retryable and may_retry and retrying.retries(self.retry_policy, result.code):
            self._retry_later(f"step {step.seq} ({step.name}) failed: {result.message}")
        return self._step_failed(step, result.code or store.ACTION_FAILED, result.message)

    # -- common paths --------------------------------------------------------

    def _call(self, step: _Step, hook: str, allowed: tuple) -> Any:
        """Call an action hook with the lease kept alive, and validate what it returns."""
        if self.keeper:
            external = hook == "run" and step.action.effect.is_external
            self.keeper.action_started(self.run_id, step.action.timeout, external=external)
        if hook == "run" and step.rate_dispatch is not None:
            flow.stamp_dispatch(self.using, step.rate_dispatch)
            step.rate_dispatch = None
        try:
            result = hooks.call(
                getattr(step.action, hook), step.ctx, step.input, _timeout_s(step.action)
            )
        except StepFailed as exc:
            if step.action.effect.is_external:
                raise  # after dispatch nothing proves the effect absent: outcome unknown
            # A kernel service the hook used (create_child_workflow_runs) refused before
            # any effect: the step fails with that code, journaled like any other failure.
            result = Failed(exc.message, exc.code)
        finally:
            if self.keeper:
                self.keeper.action_finished(self.run_id)
        return validate_result(result, allowed, hook)

    def _authorize(self, step: _Step) -> Failed | None:
        """Ask the action just before its effect. A denial is a ``Failed``; a result that
        is not None, succeeded or failed raises ``InvalidResult``; other errors propagate."""
        if not step.action.defines("authorize"):
            return None
        try:
            result = hooks.call(
                step.action.authorize, step.ctx, step.input, _timeout_s(step.action)
            )
        except PermissionDenied as exc:
            return Failed(str(exc) or "permission denied", store.FORBIDDEN)
        if result is None or isinstance(result, Succeeded):
            return None
        if isinstance(result, Failed):
            return Failed(result.message, result.code or store.FORBIDDEN)
        raise InvalidResult(f"authorize() returned {result!r}")

    def _authorize_outside_tx(self, step: _Step) -> Failed | None:
        try:
            return self._authorize(step)
        except InvalidResult as exc:
            self._fail_run(
                store.INVALID_ACTION_RESULT, f"step {step.seq} ({step.name}): {exc}", step=step
            )
        except (LeaseLost, RunCanceled, Suspend):
            raise
        except Exception as exc:
            if weather.is_connection_error(exc):
                raise
            self._retry_later(f"step {step.seq} ({step.name}): authorize() raised {exc!r}")
        raise AssertionError("unreachable")

    def _charge_before_dispatch(self, step: _Step) -> None:
        def charge() -> None:
            self._fence(step.seq)
            self._charge(step)

        try:
            db.run_in_transaction(charge, self.using)
        except budgets.BudgetExceeded as exc:
            self._step_failed(step, store.EFFECT_BUDGET_EXCEEDED, str(exc))

    def _apply(self, step: _Step, result: Any) -> Any:
        if isinstance(result, Succeeded):
            return self._journal_success(step, result)
        if isinstance(result, Waiting):
            self._park(step.seq, step.name, result.dependency)
        if result.retryable and retrying.retries(self.retry_policy, result.code):
            self._retry_later(f"step {step.seq} ({step.name}) failed: {result.message}")
        return self._step_failed(step, result.code or store.ACTION_FAILED, result.message)

    def _new_entry(
        self,
        step: _Step,
        state: str,
        result: Succeeded | None = None,
        code: str = "",
        message: str = "",
    ) -> JournalEntry:
        return JournalEntry(
            run_id=self.run_id,
            seq=step.seq,
            action_name=step.name,
            effect=step.action.effect.value,
            state=state,
            output=result.output if result else None,
            summary=(result.summary or "") if result else "",
            error_code=code,
            error_message=redaction.scrub_error(message) if message else "",
            input_hash=step.input_hash,
            generation=self.generation,
            started_at=step.started,
            created_at=clock.now(),
        )

    def _journaled(self, entry: JournalEntry) -> None:
        """Only after the commit: the in-memory journal follows the database, never leads it."""
        self.journal[entry.seq] = entry
        self.last_hash = entry.entry_hash
        self.effects.pop(entry.seq, None)
        # A completed step resets the counter (the fence did it in the row): a later
        # failure in this claim must count from zero, not from before the step.
        self.run.consecutive_failures = 0
        events.step_journaled(self, entry)

    def _journal_success(
        self,
        step: _Step,
        result: Succeeded,
        *,
        charge: bool = False,
        ledger_kind: str | None = None,
    ) -> Any:
        """Record a step's success: committed with this run's next write, not on its own.

        The workflow code between two steps does no I/O, so the entry can wait
        for the next step's start (``_flush_pending``; an EXTERNAL step's dispatch
        and a TRANSACTIONAL step's block write it themselves, ``_carries_pending``)
        or for the run's end, whose transaction then writes both: the finish
        costs no commit of its own. A crash in between loses only what a crash
        before the commit always lost: a PURE or IDEMPOTENT step runs again (same
        ``effect_key``), an EXTERNAL one is reconciled. A charge is never deferred: its failure
        (``EFFECT_BUDGET_EXCEEDED``) belongs to this step.
        """
        # Every path that journals flushes first; should one not, the earlier
        # success is written now rather than replaced (a gap in the journal).
        self._flush_pending()
        entry = self._new_entry(step, JournalEntry.State.SUCCEEDED, result)
        if not charge:
            self._pending = _Pending(step, entry, ledger_kind, result.output)
            # As ``_journaled`` will: a completed step resets the failure count and
            # closes its effect, which a transition merged with it must see.
            self.run.consecutive_failures = 0
            self.effects.pop(step.seq, None)
            return copy.deepcopy(entry.output)

        def write() -> None:
            self._fence(step.seq, reset_failures=True)
            self._charge(step)
            evidence.append_journal(entry, self.last_hash, self.using)

        try:
            db.run_in_transaction(write, self.using)
        except budgets.BudgetExceeded as exc:
            return self._step_failed(step, store.EFFECT_BUDGET_EXCEEDED, str(exc))
        self._journaled(entry)
        return copy.deepcopy(entry.output)

    def _flush_pending(self) -> None:
        """Commit a deferred success before anything else this run does."""
        pending = self._pending
        if pending is None:
            return
        try:
            if pending.ledger_kind is None:
                # Fence and journal entry in one statement, its own transaction.
                db.run_statement(
                    lambda: evidence.append_journal_fenced(
                        pending.entry, self.last_hash, self.using, lease_ms=store.lease_ms()
                    ),
                    self.using,
                )
            else:

                def write() -> None:
                    self._fence(pending.step.seq, reset_failures=True)
                    self._write_pending(pending)

                if not db.batches_statements(self.using) or not self._pending_batched(pending):
                    db.run_in_transaction(write, self.using)
        except (LeaseLost, RunCanceled):
            self._pending_lost(pending)
            raise
        self._pending = None
        self._journaled(pending.entry)

    def _pending_batched(self, pending: _Pending) -> bool:
        batch = _Batch(self, pending.step.seq, reset_failures=True)
        batch.pending(pending)
        return batch.commit()

    def _write_pending(self, pending: _Pending) -> str:
        """Write a deferred success in the current fenced transaction; returns its hash."""
        if pending.ledger_kind:
            self._ledger(
                pending.step,
                pending.ledger_kind,
                output_hash=evidence.hash_value(pending.output),
            )
        evidence.append_journal(pending.entry, self.last_hash, self.using)
        return pending.entry.entry_hash

    def _pending_lost(self, pending: _Pending | None) -> None:
        if pending is not None and pending.ledger_kind:
            self._late_evidence(
                pending.step,
                "result arrived after the run was taken over or canceled",
                output=pending.output,
            )

    def _step_failed(self, step: _Step, code: str, message: str) -> Any:
        """Journal a final failure of the step and raise ``StepFailed`` into the workflow."""
        self._flush_pending()  # the failure chains to an earlier success, written first
        entry = self._new_entry(step, JournalEntry.State.FAILED, code=code, message=message)

        def write() -> None:
            self._fence(step.seq, reset_failures=True)
            evidence.append_journal(entry, self.last_hash, self.using)

        db.run_in_transaction(write, self.using)
        self._journaled(entry)
        raise StepFailed(code, message)

    def _ledger_values(
        self, step: _Step, kind: str, *, with_hashes: bool = False, **fields: Any
    ) -> dict[str, Any]:
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
                principal_hash=evidence.hash_value(self.principal),
                idempotency_key_hash=evidence.hash_optional(self.run.idempotency_key),
                detail={k: v for k, v in step.refs.items() if v} or None,
            )
        values.update(fields)
        if values.get("message"):
            values["message"] = redaction.scrub_error(values["message"])
        return values

    def _ledger(self, step: _Step, kind: str, *, with_hashes: bool = False, **fields: Any) -> None:
        values = self._ledger_values(step, kind, with_hashes=with_hashes, **fields)
        evidence.append_ledger(self.using, expect=self.ledger_head, **values)
        self._ledger_written(step, kind)

    def _ledger_written(self, step: _Step, kind: str, *, committed: bool = False) -> None:
        events.ledger_written(
            self,
            self.using,
            seq=step.seq,
            kind=kind,
            effect=step.action.effect.value,
            effect_key=step.ctx.effect_key,
            committed=committed,
        )

    def _ledger_event(self, step: _Step, kind: str, *, message: str = "", fenced: bool) -> None:
        def write() -> None:
            if fenced:
                self._fence(step.seq)
            self._ledger(step, kind, message=message)

        db.run_in_transaction(write, self.using)

    def _late_evidence(self, step: _Step, message: str, output: Any = None) -> None:
        """A fenced-out worker's result is evidence for the operator, never applied."""

        def write() -> None:
            db.lock_run(self.using, self.run_id)
            self._ledger(
                step,
                LedgerEntry.Kind.LATE_RESULT,
                message=message,
                output_hash=evidence.hash_value(output) if output is not None else "",
                # Never the raw output: it may hold card tokens or credentials (#9).
                detail={"output": evidence.redacted_summary(output)}
                if output is not None
                else None,
            )

        try:
            db.run_in_transaction(write, self.using)
        except Exception:
            logger.exception(
                "run %s step %s: could not record late evidence", self.run_id, step.seq
            )

    # -- run transitions -----------------------------------------------------

    def _transition(
        self,
        sql: str,
        params: list[Any],
        outcome: str,
        *,
        terminal: bool,
        entry: JournalEntry | None = None,
        verify: bool = False,
        announce: dict[str, Any] | None = None,
        reason: str = "",
    ) -> None:
        """Fence, then change the run's status (and wake a parent when it ends).

        ``announce``: the signal and its arguments to send once this commits.
        ``reason``: the (already scrubbed) why, logged with the change.
        """
        broken: list[str] = []
        pending = self._pending

        def write() -> None:
            if pending is not None:
                self._fence(pending.step.seq, reset_failures=True)
            else:
                self._fence()
            if verify:
                # The fence holds the row lock, and this statement's snapshot is newer
                # than the lock: every entry of the run is in it. One round trip.
                problem = self._chains_problem(preload(self.using, [self.run_id]))
                if problem is not None:
                    broken.append(problem)
                    return
            prev = self.last_hash
            if pending is not None:
                # The last step's success commits with the run's end: one commit, not two.
                prev = self._write_pending(pending)
            if entry is not None:
                evidence.append_journal(entry, prev, self.using)
            db.execute(self.using, sql, [*params, self.run_id])
            if terminal and self.run.parent_id:
                wake_parent(self.using, self.run)
            if announce is not None:
                signals.send_on_commit(
                    using=self.using,
                    run_id=self.run_id,
                    workflow_name=self.run.workflow_name,
                    **announce,
                )

        try:
            db.run_in_transaction(write, self.using)
        except (LeaseLost, RunCanceled):
            self._pending_lost(pending)
            raise
        if broken:
            self._chain_broken(broken[0])
        if pending is not None:
            self._pending = None
            self._journaled(pending.entry)
        if entry is not None:
            self._journaled(entry)
        if outcome in seals.SEALED_STATUSES:
            self._witness_end(outcome)
        events.run_changed(self, outcome, reason=reason)
        self.outcome = outcome
        raise Suspend

    def _chains_problem(self, loaded: dict[Any, Preloaded]) -> str | None:
        """What breaks this run's chains in a fresh read of it (``preload``), or None."""
        again = loaded.get(self.run_id)
        problem = again and evidence.verify_run(again.run, again.journal, again.ledger)
        return str(problem) if problem else None

    def _chain_broken(self, problem: str) -> None:
        """Before a success: the chains did not verify, and nothing committed. The run
        needs attention; the deferred success, if any, goes with the incident."""
        logger.error("run %s: integrity chain broken: %s", self.run_id, problem)
        self._needs_attention(store.INTEGRITY_CHAIN_BROKEN, problem, step=None)

    def _succeed_run(self, output: Any) -> None:
        pending = self._pending
        with contextlib.suppress(Suspend):
            if pending is None or pending.ledger_kind is None or self._batches_end():
                # Returns only when batched writes were refused: nothing was written.
                self._finish(output, pending)
            run_output = canonical_json(output)
            self._transition(
                """UPDATE k2b_run SET status = 'succeeded', output = %s, end_seal = %s,
                          error_code = '', error_message = '', finished_at = k2b_now(),
                          lease_expires_at = NULL, consecutive_failures = 0,
                          updated_at = k2b_now() WHERE id = %s""",
                [run_output, self._end_seal("succeeded", "", run_output)],
                "succeeded",
                terminal=True,
                verify=True,
                announce={"signal": signals.run_finished, "status": "succeeded", "error_code": ""},
            )

    def _batches_end(self) -> bool:
        """Whether the run's end may go as batched statements (``_end_as_written``, or
        "BEGIN; read" then "writes; COMMIT"); a child, which also wakes its parent,
        goes through Django's transaction."""
        return not self.run.parent_id and db.batches_statements(self.using)

    def _finish(self, output: Any, pending: _Pending | None) -> None:
        """The common end: the chains verified, then the run's end in one statement that
        fences and, with the last step's deferred success, journals and seals.

        When this execution wrote every entry of the run, that statement verifies
        them itself (``_end_as_written``): one round trip. Otherwise, or when it
        finds anything else, the chains are read and verified (``_end_as_read``).
        Returns only when batched writes were refused: nothing was written.
        """
        ended = self._batches_end() and self._end_as_written(output, pending)
        if not ended and not self._end_as_read(output, pending):
            return
        signals.send_on_commit(
            using=self.using,
            run_id=self.run_id,
            workflow_name=self.run.workflow_name,
            signal=signals.run_finished,
            status="succeeded",
            error_code="",
        )
        if pending is not None:
            self._pending = None
            self._journaled(pending.entry)
        self._witness_end("succeeded")
        events.run_changed(self, "succeeded", reason="")
        self.outcome = "succeeded"
        raise Suspend

    def _witness_end(self, status: str) -> None:
        witness.ended(self.run_id, status, self.generation, *self._ledger_end())

    def _ledger_end(self) -> tuple[int, str | None]:
        """The ledger's length and head as this execution last wrote or read them."""
        head = self.ledger_head
        return (0, None) if head is None else (head.count, head.head)

    def _written_chains(self) -> evidence.WrittenChains | None:
        """The run's chains as this execution verified (at its claim) and wrote them, or
        None unless it knows every entry's row version."""
        head = self.ledger_head
        versions = [evidence.row_version(self.journal[seq]) for seq in sorted(self.journal)]
        if head is None or head.versions is None or None in versions:
            return None
        loaded = self._loaded_anchors
        return evidence.WrittenChains(
            self.run_id,
            evidence.current_anchor(
                self.run_id, "journal", len(versions), self.last_hash, loaded["journal"]
            ),
            [v for v in versions if v],
            evidence.current_anchor(self.run_id, "ledger", head.count, head.head, loaded["ledger"]),
            head.versions,
        )

    def _end_as_written(self, output: Any, pending: _Pending | None) -> bool:
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
        chains = self._written_chains()
        if chains is None:
            return False
        batch = self._end_batch(output, pending, chains)
        try:
            rows = db.commit_batch(self.using, batch.statements)
        except db.BatchRefused as exc:
            logger.info("run %s: end as written refused (%s)", self.run_id, exc)
            return False
        if rows[0] is None:  # the UPDATE alone found nothing: an empty transaction
            return False
        if pending is not None:
            evidence.fenced_journal_written(pending.entry, self.using, rows[0])
        batch.committed(rows)
        return True

    def _end_batch(
        self,
        output: Any,
        pending: _Pending | None,
        chains: evidence.WrittenChains | None = None,
    ) -> _Batch:
        """The run's end as a batch: the statement that fences and ends the run (with the
        last step's deferred success, journaling and sealing it), then that success's
        ledger entry if it has one (then strict). With ``chains`` the first statement
        also checks them as written (``evidence.AS_WRITTEN_CHECK``), strict too."""
        run_output = canonical_json(output)
        sealed = self._end_seal("succeeded", "", run_output)
        if pending is not None:
            sql, params = evidence.fenced_journal_statement(
                pending.entry,
                self.last_hash,
                run_output=run_output,
                end_seal=sealed,
                strict=pending.ledger_kind is not None,
                as_written=chains,
            )
        elif chains is not None:
            sql = _AS_WRITTEN_FINISH_SQL
            params = [run_output, sealed, self.run_id, self.generation, *chains.params()]
        else:
            sql, params = _FINISH_SQL, [run_output, sealed, self.run_id, self.generation]
        batch = _Batch(self)
        batch.add((sql, params), pending.entry if pending is not None else None)
        if pending is not None:
            batch.pending_ledger(pending)  # nothing for a success without a ledger kind
        return batch

    def _end_as_read(self, output: Any, pending: _Pending | None) -> bool:
        """The run's end after a read of its chains, verified here.

        The verifying read is one statement, so the run row (its anchors) and every
        entry come from one snapshot: an append commits both or neither, so the view
        is consistent without a lock. Read and write share one transaction: one
        commit, and two round trips where statements can be batched ("BEGIN; read",
        "writes; COMMIT"); a child goes through Django's transaction. A break rolls
        back and leaves the run to ``_needs_attention``, the deferred success with
        it, as ``_transition`` does.

        An EXTERNAL step's deferred success also has its ledger entry: then only
        batched, as strict appends (``_Batch``), and this returns False, having
        written nothing, when they are refused (``_transition`` then ends the run).
        """
        batch = self._end_batch(output, pending)
        sql, params = batch.statements[0]
        broken: list[str] = []

        def finished(row: tuple | None) -> None:
            if pending is not None:
                evidence.fenced_journal_written(pending.entry, self.using, row)
            elif row is None:
                raise db.lease_lost(self.using, self.run_id, self.generation)

        def verified(loaded: dict[Any, Preloaded]) -> bool:
            problem = self._chains_problem(loaded)
            if problem:
                broken.append(problem)
            return not problem

        def write() -> None:
            if verified(preload(self.using, [self.run_id])):
                written = db.fetch_statement(self.using, sql, list(params))
                finished(written[0] if written else None)
                if self.run.parent_id:
                    wake_parent(self.using, self.run)

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
            logger.info("run %s: batched end refused (%s)", self.run_id, exc)
            return False
        except (LeaseLost, RunCanceled):
            self._pending_lost(pending)
            raise
        if broken:
            self._chain_broken(broken[0])
        return True

    def _end_seal(self, status: str, code: str, output_text: str = "null") -> str:
        """The seal of this run ending (or parking for an operator) in this generation."""
        return seals.end_seal(self.run_id, status, code, self.generation, output_text)

    def _fail_run(self, code: str, message: str, step: _Step | None = None) -> None:
        """Fail the run for good (journaling the step's failure when there is one)."""
        message = redaction.scrub_error(message)  # exception texts may carry credentials
        entry = None
        if step is not None and step.seq not in self.journal:
            entry = self._new_entry(step, JournalEntry.State.FAILED, code=code, message=message)
        self._transition(
            """UPDATE k2b_run SET status = 'failed', error_code = %s, error_message = %s,
                      end_seal = %s, finished_at = k2b_now(), lease_expires_at = NULL,
                      updated_at = k2b_now()
                WHERE id = %s""",
            [code, message, self._end_seal("failed", code)],
            "failed",
            terminal=True,
            entry=entry,
            announce={"signal": signals.run_finished, "status": "failed", "error_code": code},
            reason=f"{code}: {message}",
        )

    def _needs_attention(
        self, code: str, message: str, step: int | None, detail: dict | None = None
    ) -> None:
        message = redaction.scrub_error(message)
        self._transition(
            """UPDATE k2b_run SET status = 'needs_attention', error_code = %s, error_message = %s,
                      error_detail = %s, attention_step = %s, end_seal = %s,
                      lease_expires_at = NULL, updated_at = k2b_now()
                WHERE id = %s""",
            [
                code,
                message,
                canonical_json(detail) if detail else None,
                step,
                self._end_seal("needs_attention", code),
            ],
            "needs_attention",
            terminal=False,
            announce={
                "signal": signals.run_needs_attention,
                "error_code": code,
                "message": message,
                "step": step,
            },
            reason=f"{code}: {message}",
        )

    def _retry_later(self, reason: str) -> None:
        """A retryable failure: count it, back off, or give up past the limit."""
        reason = redaction.scrub_error(reason)  # stored and logged: no credentials, bounded
        failures = self.run.consecutive_failures + 1
        if failures >= retrying.max_attempts(self.retry_policy):
            self._exhausted(failures, reason)
        delay = retrying.delay_ms(self.retry_policy, failures)
        logger.info("run %s: retry %s in %s ms: %s", self.run_id, failures, delay, reason)
        self._transition(
            """UPDATE k2b_run SET status = 'queued', consecutive_failures = %s,
                      run_after = k2b_now() + %s * interval '1 millisecond',
                      error_message = %s, lease_expires_at = NULL, claimed_by = '',
                      updated_at = k2b_now()
                WHERE id = %s""",
            [failures, delay, reason],
            "retry",
            terminal=False,
        )

    def _exhausted(self, failures: int, reason: str) -> None:
        message = f"{failures} consecutive failures; last: {reason}"
        open_steps = [seq for seq, state in self.effects.items() if state.open_key]
        if open_steps:
            # An effect may have happened: never just fail, an operator decides.
            self._needs_attention(store.WORKFLOW_RETRY_EXHAUSTED, message, step=open_steps[0])
        self._fail_run(store.WORKFLOW_RETRY_EXHAUSTED, message)

    def _park(
        self, seq: int, action: str, dependency: Any, pending: tuple[_Step, str] | None = None
    ) -> None:
        """Park on ``dependency``; with ``pending``, also record the provider's "pending"."""
        parked: list[bool] = []

        def write() -> None:
            self._fence(seq)
            if pending is not None:
                self._ledger(pending[0], LedgerEntry.Kind.PENDING, message=pending[1])
            parked.append(
                waits.park(
                    self.using,
                    run_id=self.run_id,
                    app_id=self.app_id,
                    step=seq,
                    dependency=dependency,
                    action=action,
                    seen_kind=self.run.wait_kind,
                    seen_key=self.run.wait_key,
                    seen_seq=self.run.wait_signal_seq,
                )
            )

        db.run_in_transaction(write, self.using)
        self.outcome = "waiting" if parked[-1] else "rewoken"
        if self.trace is not None:
            self.trace.waiting(seq, dependency)
        events.run_changed(self, self.outcome, step=seq)
        raise Suspend

    def _lost_connection(self, exc: BaseException) -> None:
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
        self.outcome = "db_unavailable"
        self._release_after_unknown_commit()
        raise Suspend

    def _release_after_unknown_commit(self) -> None:
        """Hand the run back on a fresh connection; the worker retries it if even that fails."""
        from .claim import release

        weather.close_quietly(self.using)
        try:
            release(self.using, self.run_id, self.generation)
        except DatabaseError:
            weather.close_quietly(self.using)
            self.release_pending = True

    # -- run.children --------------------------------------------------------

    def children(self, name: str, inputs: list[Any], *, wait: bool = True) -> Any:
        """``run.children`` (``wait``) or ``create_child_workflow_runs(run, ...)`` (not)."""
        from . import children

        self._flush_pending()
        self._check_shutdown()
        seq = self.next_seq
        self.next_seq += 1
        action_name = f"{CHILDREN_KIND}:{name}"
        try:
            inputs = validation.child_inputs(inputs, f"inputs of children step {seq}")
        except (InvalidInput, TypeError) as exc:
            self._fail_run(store.INVALID_STEP_INPUT, str(exc))
        input_hash = evidence.hash_value(inputs)
        if not wait:
            action_name = f"{CHILDREN_KIND}.create:{name}"
        entry = self.journal.get(seq)
        if entry is None:
            self._check_parked_step(seq, action_name, input_hash)
        else:
            replayed = self._replay(entry, action_name, inputs, input_hash)
            return (
                [r["run_id"] for r in replayed]
                if not wait
                else [ChildResult(**r) for r in replayed]
            )
        step = _Step(
            seq,
            _ChildrenAction(),
            action_name,
            inputs,
            input_hash,
            clock.now(),
            StepContext(self, seq),
        )
        if seq >= self.definition.max_steps:  # a children call is a step of the loop budget too
            return self._step_failed(
                step,
                store.MAX_STEPS_EXCEEDED,
                f"step {seq} is past max_steps={self.definition.max_steps}",
            )
        if len(inputs) > store.max_children_per_step():
            return self._step_failed(
                step,
                store.FAN_OUT_EXCEEDED,
                f"{len(inputs)} children asked, at most {store.max_children_per_step()} per step",
            )
        results: list[dict] = []
        failure: list[tuple[str, str]] = []
        tampered: list[str] = []

        def write() -> None:
            self._fence(seq)
            try:
                ids = children.create(
                    self.using, parent=self.run, step=seq, name=name, inputs=inputs
                )
            except budgets.BudgetExceeded as exc:
                failure.append((store.MAX_STEPS_EXCEEDED, str(exc)))
                return
            except UnknownWorkflow as exc:
                failure.append(("UNKNOWN_WORKFLOW", str(exc)))
                return
            try:
                rows = children.results(self.using, self.run_id, seq)
            except seals.SealBroken as exc:
                tampered.append(str(exc))
                return
            if not wait or all(r["done"] for r in rows):
                output = (
                    [children.public(r) for r in rows]
                    if wait
                    else [{"run_id": str(i)} for i in ids]
                )
                entry = self._new_entry(step, JournalEntry.State.SUCCEEDED, Succeeded(output))
                evidence.append_journal(entry, self.last_hash, self.using)
                results.append({"entry": entry})
                return
            parked = waits.park(
                self.using,
                run_id=self.run_id,
                app_id=self.app_id,
                step=seq,
                dependency=children.dependency(self.run_id, seq),
                action=action_name,
                seen_kind=self.run.wait_kind,
                seen_key=self.run.wait_key,
                seen_seq=self.run.wait_signal_seq,
            )
            results.append({"parked": parked})

        db.run_in_transaction(write, self.using)
        if tampered:
            self._chain_broken(tampered[0])
        if failure:
            return self._step_failed(step, *failure[0])
        last = results[-1]
        if "entry" in last:
            self._journaled(last["entry"])
            if not wait:
                return [r["run_id"] for r in last["entry"].output]
            return [ChildResult(**r) for r in last["entry"].output]
        self.outcome = "waiting" if last["parked"] else "rewoken"
        events.run_changed(self, self.outcome, step=seq)
        raise Suspend


class _ChildrenAction(Action):
    name = CHILDREN_KIND
    effect = Effect.PURE


class _PatchAction(Action):
    name = PATCH_KIND
    effect = Effect.PURE


def _timeout_s(action: Action) -> float:
    """The action's timeout in seconds, as the lease keeper counts it."""
    return action.timeout if action.timeout is not None else store.action_timeout_ms() / 1000


def _has_other_versions(name: str) -> bool:
    from ..workflows import registered_workflows

    return name in registered_workflows()


@dataclass
class _Pending:
    """A step's success whose journal entry (and ledger entry) is not committed yet."""

    step: _Step
    entry: JournalEntry
    ledger_kind: str | None
    output: Any


class _Batch:
    """The writes of one transaction of a run, sent with BEGIN and COMMIT in one round
    trip (``db.commit_batch``) instead of a round trip each.

    Each write is a strict append (``evidence``): one that does not find the run
    and its chains as this execution believes fails, and the transaction with it.
    The first also fences the run, holding its row lock for the rest. Nothing is
    applied to the execution (ledger head, hashes, events) before the commit.
    ``commit()`` False: nothing was written (not ours any more, a chain moved by
    someone else; a conflict is retried by ``db.commit_batch``); the caller runs
    the same writes one statement at a time, which knows why and says so.
    """

    def __init__(
        self, execution: Execution, step: int | None = None, *, reset_failures: bool = False
    ) -> None:
        self.execution = execution
        self.fence: evidence.Fence | None = evidence.Fence(
            execution.generation, store.lease_ms(), step, reset_failures
        )
        head = execution.ledger_head
        assert head is not None, "a run writes once loaded"
        self.head = evidence.LedgerHead(head.count, head.head)
        self.last_hash = execution.last_hash
        self.statements: list[db.Statement] = []
        self.entries: list[JournalEntry | LedgerEntry | None] = []
        self.written: list[tuple[_Step, str]] = []

    def _fence(self) -> evidence.Fence | None:
        fence, self.fence = self.fence, None
        return fence

    def add(self, statement: db.Statement, entry: JournalEntry | LedgerEntry | None) -> None:
        """A statement that carries its own fence, such as the run's end; first."""
        self.fence = None
        self.statements.append(statement)
        self.entries.append(entry)

    def ledger(self, step: _Step, kind: str, *, with_hashes: bool = False, **fields: Any) -> None:
        values = self.execution._ledger_values(step, kind, with_hashes=with_hashes, **fields)
        entry, statement = evidence.ledger_statement(
            self.execution.using, self.head, self._fence(), **values
        )
        self.statements.append(statement)
        self.entries.append(entry)
        self.written.append((step, kind))

    def journal(self, entry: JournalEntry) -> None:
        self.statements.append(evidence.journal_statement(entry, self.last_hash, self._fence()))
        self.entries.append(entry)
        self.last_hash = entry.entry_hash

    def pending(self, pending: _Pending) -> None:
        """A deferred success, as ``Execution._write_pending`` writes it."""
        self.pending_ledger(pending)
        self.journal(pending.entry)

    def pending_ledger(self, pending: _Pending) -> None:
        if pending.ledger_kind:
            self.ledger(
                pending.step, pending.ledger_kind, output_hash=evidence.hash_value(pending.output)
            )

    def commit(self) -> bool:
        """Send it all with BEGIN and COMMIT; False when a guard refused it."""
        try:
            rows = db.commit_batch(self.execution.using, self.statements)
        except db.BatchRefused as exc:
            logger.info("run %s: batched writes refused (%s)", self.execution.run_id, exc)
            return False
        self.committed(rows)
        return True

    def committed(self, rows: list[tuple | None]) -> None:
        execution = self.execution
        for entry, row in zip(self.entries, rows, strict=True):
            if entry is not None and row is not None:
                evidence.stored(entry, execution.using, row)
        head = execution.ledger_head
        assert head is not None, "a run writes once loaded"
        for entry in self.entries:
            if isinstance(entry, LedgerEntry):
                head.appended(entry)  # in order, as the batch's own head moved past each
        for step, kind in self.written:
            execution._ledger_written(step, kind, committed=True)


@dataclass
class _Step:
    seq: int
    action: Action
    name: str
    input: Any
    input_hash: str
    started: Any
    ctx: StepContext
    cost: dict[str, int] = field(default_factory=dict)
    refs: dict[str, Any] = field(default_factory=dict)
    #: A reserved rate-limited dispatch, stamped just before ``run()`` (``flow.py``).
    rate_dispatch: int | None = None


def wake_parent(using: str, run: WorkflowRun) -> None:
    """A child ended: wake its parent's children step (inside the child's transaction)."""
    from . import children

    rows = db.fetchall(using, "SELECT app_id FROM k2b_run WHERE id = %s", [run.parent_id])
    if rows:
        dep = children.dependency(run.parent_id, run.parent_step)
        waits.wake(using, app_id=rows[0][0], kind=dep.kind, key=dep.key)
