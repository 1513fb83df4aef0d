"""Starting, canceling, waking, resolving and retrying runs: what user code calls.

Every function joins the caller's transaction when there is one: nothing it
does is visible (or wakes a worker) unless that transaction commits.
"""

from __future__ import annotations

import functools
import uuid
from typing import TYPE_CHECKING, Any, cast

from django.core.exceptions import PermissionDenied
from django.db import connections, transaction

from . import codes, signals, store, tracing, validation
from .actions import to_json_value
from .dedup import insert_values
from .exceptions import (
    EvidenceChanged,
    IdempotencyConflict,
    InvalidInput,
    NotRetryable,
    ResolutionRefused,
    StepFailed,
)
from .kernel import children, clock, db, flow, seals, waits, witness
from .kernel import evidence as chain
from .kernel.budgets import BudgetExceeded
from .kernel.context import KernelStepContext
from .limits import Strategy
from .models import (
    TERMINAL_STATUSES,
    BudgetAccount,
    JournalEntry,
    LedgerEntry,
    RunStatus,
    WorkflowRun,
)
from .workflows import RunHandle, get_workflow

if TYPE_CHECKING:
    import datetime as dt

    from .dryrun import _DryExecution

EFFECT_CONFIRMED = "effect_confirmed"
EFFECT_ABSENT = "effect_absent"
RESOLUTION_DECISIONS = (EFFECT_CONFIRMED, EFFECT_ABSENT)
RESOLVABLE_CODES = (codes.EFFECT_OUTCOME_UNKNOWN, codes.WORKFLOW_RETRY_EXHAUSTED)
#: Incidents an operator ends with "retry": the cause is the code or the stored
#: evidence, so a retry after a fix (a deploy, a patch, restored rows) replays anew.
RETRYABLE_INCIDENT_CODES = (
    codes.WORKFLOW_NONDETERMINISTIC,
    codes.WORKFLOW_CODE_ERROR,
    codes.INTEGRITY_CHAIN_BROKEN,
)


def start_workflow_run(
    name: str,
    input: Any,
    *,
    idempotency_key: str | None = None,
    principal: Any = None,
    parent: WorkflowRun | uuid.UUID | str | None = None,
    version: int | None = None,
    concurrency_key: str | None = None,
    priority: int = 0,
    run_after: Any = None,
    schedule_id: str | None = None,
    scheduled_for: Any = None,
) -> WorkflowRun:
    """Queue a run of workflow ``name``. The same ``idempotency_key`` returns the same run.

    The run is pinned to ``version`` (default: the newest registered here) for
    its whole life. ``concurrency_key`` (for a workflow declaring
    ``concurrency=Concurrency(...)``) limits the active runs sharing it;
    ``priority`` (0 to 1000, higher first, aged by ``PRIORITY_AGING_MS``) orders
    claims; ``run_after`` (an aware datetime) delays the first claim.
    ``schedule_id`` and ``scheduled_for`` are set by schedule passes
    (``kernel/schedules.py``) and the admin's "run now".

    Raises ``UnknownWorkflow`` or ``InvalidInput`` before creating anything,
    ``IdempotencyConflict`` when the key names a run started with another input,
    and ``DatabaseNotMigrated`` when the app's tables are missing.
    """
    validation.text(name, "the workflow name", max_length=200)
    validation.integer(version, "version", minimum=1, maximum=validation.MAX_INT, optional=True)
    definition = get_workflow(name, version)
    if input is None:
        raise InvalidInput("the workflow input must not be None (use {} for no input)")
    input = to_json_value(input, "the workflow input")
    principal = to_json_value(principal, "the principal")
    if idempotency_key is not None:
        validation.text(idempotency_key, "idempotency_key", max_length=255)
    parent_id = None if parent is None else validation.run_id(parent, "parent")
    now = clock.now()
    flow_fields = flow.start_fields(
        definition,
        concurrency_key=concurrency_key,
        priority=priority,
        run_after=run_after,
        now=now,
    )
    # Set on the run by _start with the flow fields: which schedule's tick started it.
    flow_fields["schedule_id"] = schedule_id
    flow_fields["scheduled_for"] = scheduled_for
    using = store.database()
    if concurrency_key is not None:
        # A keyed start may cancel holders or count them under the key's lock:
        # that and the insert commit together.
        with db.schema_required(), transaction.atomic(using=using):
            return _start(
                using,
                name,
                input,
                definition,
                idempotency_key,
                principal,
                parent_id,
                now,
                flow_fields,
            )
    with db.schema_required():
        return _start(
            using, name, input, definition, idempotency_key, principal, parent_id, now, flow_fields
        )


def _start(
    using: str,
    name: str,
    input: Any,
    definition: Any,
    idempotency_key: str | None,
    principal: Any,
    parent_id: uuid.UUID | None,
    now: dt.datetime,
    flow_fields: dict[str, Any],
) -> WorkflowRun:
    parent_run = None
    if parent_id is not None:
        parent_run = WorkflowRun.objects.using(using).filter(pk=parent_id).first()
        if parent_run is None:
            raise InvalidInput(f"parent run {parent_id} does not exist")
    run_id = uuid.uuid4()
    run = WorkflowRun(
        id=run_id,
        workflow_name=name,
        workflow_version=definition.version,
        app_id=definition.app_id,
        status=RunStatus.QUEUED,
        input=input,
        idempotency_key=idempotency_key,
        principal=principal,
        created_at=now,
        updated_at=now,
        timeout_at=definition.timeout_at(now),
        parent=parent_run,
        root_id=(parent_run.root_id or parent_run.id) if parent_run else run_id,
        # The caller's W3C trace context: whichever worker runs it continues the trace.
        trace_context=tracing.capture() if tracing.ENABLED else None,
        **chain.initial_anchors(run_id),
        **flow_fields,
    )
    run.start_seal = seals.start_seal(run)
    key = flow_fields.get("concurrency_key")
    if key is not None and definition.concurrency is not None:
        if idempotency_key is not None:
            # A repeated start must not cancel (or be refused by) the runs of its key.
            existing = _existing_run(using, name, idempotency_key, input, principal)
            if existing is not None:
                return existing
        strategy = definition.concurrency.strategy
        if strategy == Strategy.CANCEL_NEWEST and not flow.has_room(using, definition, key):
            run.status = RunStatus.CANCELED
            run.error_code = codes.CONCURRENCY_LIMITED
            run.error_message = (
                f"concurrency_key {key!r} already has {definition.concurrency.limit} "
                "active run(s) (cancel_newest)"
            )
            run.finished_at = now
            # Born ended: sealed as every end is (kernel/seals.py).
            run.end_seal = seals.end_seal(run_id, "canceled", codes.CONCURRENCY_LIMITED, 0)
        elif strategy == Strategy.CANCEL_IN_PROGRESS:
            for holder in flow.holders_to_cancel(using, definition, key):
                cancel_workflow_run(
                    holder,
                    f"canceled by a newer run with concurrency_key {key!r} (cancel_in_progress)",
                )
    budget = None
    if parent_run is None:
        budget = BudgetAccount(
            root_id=run_id,
            effect_budget=definition.effect_budget,
            max_ai_calls=definition.max_ai_calls,
            max_steps=definition.max_steps,
        )
    if not _insert_run(using, run, budget):
        if idempotency_key is None:
            raise AssertionError("run was not created")
        # ON CONFLICT DO NOTHING without a target, then read by key: two
        # concurrent starts with one key never raise a unique violation.
        existing = _existing_run(using, name, idempotency_key, input, principal)
        assert existing is not None
        return existing
    if run.status == RunStatus.CANCELED:
        transaction.on_commit(lambda: witness.ended(run_id, "canceled", 0, 0, None), using=using)
    if key is not None:
        # The insert's trigger admitted it to a slot, or not.
        run.holds_slot = (
            WorkflowRun.objects.using(using).filter(pk=run_id).values_list("holds_slot", flat=True)
        )[0]
    return run


def _existing_run(
    using: str, name: str, idempotency_key: str, input: Any, principal: Any
) -> WorkflowRun | None:
    existing = (
        WorkflowRun.objects.using(using)
        .filter(workflow_name=name, idempotency_key=idempotency_key)
        .first()
    )
    if existing is None:
        return None
    if existing.principal != principal:
        # Neither the run nor whose it is: the key names another principal's run.
        raise IdempotencyConflict(
            f"idempotency_key {idempotency_key!r} of {name} is already used by another principal",
            None,
        )
    if existing.input != input:
        raise IdempotencyConflict(
            f"idempotency_key {idempotency_key!r} already started run {existing.id} "
            "with a different input",
            existing.id,
        )
    return existing


def _insert_run(using: str, run: WorkflowRun, budget: BudgetAccount | None) -> bool:
    """Insert ``run`` (and its root's budget account) in one statement; False when a
    unique constraint (the idempotency key) kept it out, and the account with it.

    One statement is one round trip, and outside a transaction one of its own:
    a start costs the caller no BEGIN and COMMIT of their own, and the two rows
    still commit together or not at all. The returned ``run`` is the row as
    stored: no column of it gets its value from the database.
    """
    connection = connections[using]
    table, insert, params = insert_values(run, connection)
    sql = f"INSERT INTO {table} {insert} ON CONFLICT DO NOTHING RETURNING id"
    if budget is not None:
        table, insert, budget_params = insert_values(budget, connection, select=True)
        sql = f"WITH run AS ({sql}) INSERT INTO {table} {insert} FROM run RETURNING root_id"
        params = [*params, *budget_params]
    # As Django's own saves: an error inside the caller's atomic block marks it
    # for rollback, so their next query says so instead of failing obscurely.
    with transaction.mark_for_rollback_on_error(using), connection.cursor() as cursor:
        cursor.execute(sql, params)
        created = cursor.fetchone() is not None
    for obj in (run, budget):
        if obj is not None and created:
            obj._state.adding = False
            obj._state.db = using
    return created


def cancel_workflow_run(run_id: uuid.UUID | str, reason: str) -> WorkflowRun:
    """Cancel a run and its whole subtree of children, with their AI tasks.

    Running actions and providers see ``ctx.canceled`` / their abort event;
    whatever they return afterwards is discarded. A run that already ended is
    returned unchanged.
    """
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidInput("cancel_workflow_run() needs a reason")
    validation.long_text(reason, "the cancel reason")
    return cancel_run(validation.run_id(run_id), reason)


def cancel_run(
    run_id: uuid.UUID, reason: str, *, code: str = codes.CANCELED, overdue: bool = False
) -> WorkflowRun:
    """``cancel_workflow_run`` with its error code; with ``overdue``, only a run whose
    ``timeout_at`` has passed and that is still queued, running or waiting, checked
    under its lock (the timeout sweep, ``timeouts.py``)."""
    using = store.database()

    def cancel() -> WorkflowRun:
        row = db.lock_run(using, run_id)
        if row is None:
            raise WorkflowRun.DoesNotExist(f"no run {run_id}")
        if row[0] in TERMINAL_STATUSES:
            return WorkflowRun.objects.using(using).get(pk=run_id)
        if overdue and not db.fetchall(
            using,
            """SELECT 1 FROM k2b_run WHERE id = %s AND timeout_at <= k2b_now()
                  AND status IN ('queued', 'running', 'waiting')""",
            [run_id],
        ):
            return WorkflowRun.objects.using(using).get(pk=run_id)
        canceled = db.fetchall(
            using,
            """WITH RECURSIVE tree AS (
                   SELECT id FROM k2b_run WHERE id = %s
                   UNION ALL
                   SELECT r.id FROM k2b_run r JOIN tree t ON r.parent_id = t.id)
               UPDATE k2b_run SET status = 'canceled', error_code = %s, error_message = %s,
                      finished_at = k2b_now(), updated_at = k2b_now(),
                      -- A running holder keeps its lease, and with it its slot, until
                      -- its worker has left run() (#35: triggers.SlotRelease).
                      lease_expires_at = CASE WHEN status = 'running' AND holds_slot
                                              THEN lease_expires_at END
                WHERE id IN (SELECT id FROM tree)
                  AND status NOT IN ('succeeded', 'failed', 'canceled')
               RETURNING id, workflow_name, generation""",
            [run_id, code, reason],
        )
        ids = [r[0] for r in canceled]
        db.execute(
            using,
            """UPDATE k2b_run r SET end_seal = s.seal
                 FROM unnest(%s::uuid[], %s::text[]) AS s(id, seal) WHERE r.id = s.id""",
            [
                ids,
                seals.end_seals((i, "canceled", code, gen) for i, _, gen in canceled),
            ],
        )
        for canceled_id, _, generation in canceled:
            transaction.on_commit(
                functools.partial(witness.ended, canceled_id, "canceled", generation, 0, None),
                using=using,
            )
        for canceled_id, workflow_name, _ in canceled:
            signals.send_on_commit(
                signals.run_finished,
                using,
                run_id=canceled_id,
                workflow_name=workflow_name,
                status="canceled",
                error_code=code,
            )
        db.execute(
            using,
            """UPDATE k2b_ai_task SET status = 'canceled', finished_at = k2b_now(),
                      updated_at = k2b_now(), lease_expires_at = NULL
                WHERE run_id = ANY(%s) AND status IN ('queued', 'running')""",
            [ids],
        )
        chain.append_ledger(using, run_id=run_id, kind=LedgerEntry.Kind.CANCELED, message=reason)
        run = WorkflowRun.objects.using(using).get(pk=run_id)
        if run.parent_id:
            from .kernel.children import wake_parent

            wake_parent(using, run)
        return run

    # A finishing child locks itself, then its parent (to wake it); this locks the
    # parent, then the subtree. When the two deadlock, PostgreSQL aborts one: retry.
    return db.run_in_transaction(cancel, using)


def wake_workflow_runs_waiting_on(*, app_id: str, kind: str, key: str) -> int:
    """Record a wake for ``(app_id, kind, key)`` and re-queue the runs parked on it.

    Durable and safe in any order relative to the waiter parking. Returns the
    number of runs re-queued now (a waiter that parks later finds the signal).
    """
    # The rendezvous row's columns: a longer key would fail inside the wake.
    for value, what, length in ((app_id, "app_id", 100), (kind, "kind", 200), (key, "key", 500)):
        if not isinstance(value, str) or not value:
            raise InvalidInput(f"{what} must be a non-empty string")
        validation.text(value, what, max_length=length)
    woken = waits.wake(store.database(), app_id=app_id, kind=kind, key=key)
    if tracing.ENABLED:
        tracing.woke(app_id=app_id, kind=kind, woken=woken)
    return woken


def notify_workflow_worker(app_id: str) -> None:
    """Wake idle workers of ``app_id`` now (on commit). Runs are found without it, only later."""
    waits.notify(store.database(), validation.text(app_id, "app_id", max_length=100))


def create_child_workflow_runs(
    ctx_or_run: KernelStepContext | RunHandle, name: str, inputs: list[Any]
) -> list[WorkflowRun]:
    """Create child runs of the current step without waiting for them (idempotently)."""
    if isinstance(ctx_or_run, KernelStepContext) and ctx_or_run.dry_run:
        # A dry run executes the children dry and returns unsaved runs: nothing a worker sees.
        dry = cast("_DryExecution", ctx_or_run._execution)
        return dry.planned_children(ctx_or_run.step, name, inputs)
    if isinstance(ctx_or_run, RunHandle):
        ids = ctx_or_run._execution.children(name, inputs, wait=False)
        if getattr(ctx_or_run._execution, "dry_run", False):
            return ids
    elif isinstance(ctx_or_run, KernelStepContext):
        ctx = ctx_or_run
        validation.text(name, "the child workflow name", max_length=200)
        inputs = validation.child_inputs(inputs, "child inputs")
        # StepFailed fails the calling step with this code, before anything is created.
        if len(inputs) > store.max_children_per_step():
            raise StepFailed(
                codes.FAN_OUT_EXCEEDED,
                f"{len(inputs)} children asked, at most {store.max_children_per_step()} per step",
            )
        try:
            with ctx.fenced(ctx.using):
                parent = WorkflowRun.objects.using(ctx.using).get(pk=ctx.run_id)
                ids = children.create(
                    ctx.using, parent=parent, step=ctx.step, name=name, inputs=inputs
                )
        except BudgetExceeded as exc:
            raise StepFailed(codes.MAX_STEPS_EXCEEDED, str(exc)) from None
    else:
        raise InvalidInput("create_child_workflow_runs() takes a step's ctx or a workflow's run")
    runs = WorkflowRun.objects.using(store.database()).in_bulk([str(i) for i in ids])
    return [runs[uuid.UUID(str(i))] for i in ids]


def count_child_workflow_runs(run_id: uuid.UUID | str) -> dict[str, int]:
    """``{"queued": n, "running": n, "succeeded": n, ..., "total": n}`` in one query."""
    return children.count(store.database(), validation.run_id(run_id))


def resolve_effect(
    run_id: uuid.UUID | str,
    decision: str,
    *,
    evidence: str,
    actor: Any,
    output: Any = None,
    step: int | None = None,
    seen_ledger_id: int | None = None,
) -> WorkflowRun:
    """An operator's decision on an effect whose outcome the kernel cannot know.

    ``EFFECT_CONFIRMED`` journals ``output`` as the step's result without calling
    the provider; ``EFFECT_ABSENT`` re-queues the run so the step runs again
    under a new invocation key and the same ``effect_key``. Both append a
    ledger entry naming the operator with the evidence text.

    ``step`` and ``seen_ledger_id`` (the newest ledger entry the operator was
    shown) are compared under the run lock: a decision about another step, or
    taken before a late result, a reconcile answer or another operator's
    decision arrived, raises ``ResolutionRefused`` (``EvidenceChanged``) and
    changes nothing. The admin always passes both; code calling this directly
    should too.
    """
    if decision not in RESOLUTION_DECISIONS:
        raise InvalidInput(f"decision must be EFFECT_CONFIRMED or EFFECT_ABSENT, not {decision!r}")
    if not isinstance(evidence, str) or not evidence.strip():
        raise InvalidInput("a resolution needs evidence text")
    validation.long_text(evidence, "the evidence")
    run_id = validation.run_id(run_id)
    if (
        actor is None
        or not getattr(actor, "is_active", False)
        or not actor.has_perm("k2b_workflows.resolve_effect")
    ):
        raise PermissionDenied(
            "resolving an effect needs the permission k2b_workflows.resolve_effect"
        )
    if decision == EFFECT_CONFIRMED:
        output = to_json_value(output, "the confirmed output")
    for name, value in (("step", step), ("seen_ledger_id", seen_ledger_id)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidInput(f"{name} must be an integer, not {value!r}")
    expected_step = step
    using = store.database()
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
            evidence=evidence.strip(),
        )
        if decision == EFFECT_CONFIRMED:
            chain.append_ledger(
                using,
                kind=LedgerEntry.Kind.RESOLVED_CONFIRMED,
                output_hash=chain.hash_value(output),
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
            chain.append_journal(entry, last.entry_hash if last else chain.GENESIS, using)
        else:
            chain.append_ledger(using, kind=LedgerEntry.Kind.RESOLVED_ABSENT, **common)
        db.execute(
            using,
            """UPDATE k2b_run SET status = 'queued', attention_step = NULL, error_code = '',
                      error_message = '', error_detail = NULL, consecutive_failures = 0,
                      end_seal = '',
                      run_after = k2b_now(), updated_at = k2b_now() WHERE id = %s""",
            [run_id],
        )
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
    if run.error_code != codes.WORKFLOW_RETRY_EXHAUSTED:
        return (
            f"failed with {run.error_code}, a journaled outcome that a retry would replay;"
            " only runs that exhausted their retries can be retried"
        )
    return ""


def retry_workflow_run(run_id: uuid.UUID | str, *, actor: Any, reason: str = "") -> WorkflowRun:
    """An operator's "retry now": a run that exhausted its retries, or a code incident.

    Code incidents (``RETRYABLE_INCIDENT_CODES``) are retried once a fix or a
    patch is deployed: the run replays its journal on the code now running.
    A run that failed on a journaled step failure would replay to the same
    failure, so it is refused.
    """
    if actor is None or not actor.has_perm("k2b_workflows.retry_workflowrun"):
        raise PermissionDenied(
            "retrying a run needs the permission k2b_workflows.retry_workflowrun"
        )
    run_id = validation.run_id(run_id)
    if not isinstance(reason, str):
        raise InvalidInput("the retry reason must be a string")
    reason = validation.storable_message(reason)
    using = store.database()
    with transaction.atomic(using=using):
        row = db.lock_run(using, run_id)
        if row is None:
            raise WorkflowRun.DoesNotExist(f"no run {run_id}")
        run = WorkflowRun.objects.using(using).get(pk=run_id)
        refusal = retry_refusal(run)
        if refusal:
            raise NotRetryable(f"run {run_id} is {refusal}")
        chain.append_ledger(
            using,
            run_id=run_id,
            kind=LedgerEntry.Kind.RETRIED,
            message=f"{reason} (was {run.error_code})" if run.error_code else reason,
            actor=actor.get_username(),
            actor_id=actor.pk,
            generation=run.generation,
        )
        db.execute(
            using,
            """UPDATE k2b_run SET status = 'queued', consecutive_failures = 0, end_seal = '',
                      error_code = '', error_message = '', error_detail = NULL,
                      attention_step = NULL, run_after = k2b_now(),
                      finished_at = NULL, updated_at = k2b_now()
                WHERE id = %s""",
            [run_id],
        )
    if tracing.ENABLED:
        tracing.decided(run, "retry", run.attention_step)
    return WorkflowRun.objects.using(using).get(pk=run_id)
