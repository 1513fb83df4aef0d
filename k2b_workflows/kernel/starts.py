"""The one builder of new runs: a caller's start, a schedule's tick, a step's children.

The failure this module is built around: a run row written by two hands
drifts. A run is claimed only if its start seal matches its columns
(``seals.start_seal``), its chains begin at the anchors ``evidence`` expects,
its root owns a budget account, and its flow-control columns agree with its
workflow's declaration. When a caller's start, the schedule pass and the
children step each built the row themselves, a column added to one (a trace
context, a timeout, a seal over a new field) was missed by another, and the
run it missed was refused at its claim, or worse, claimed unsealed. Every
new ``k2b_run`` row is built by ``new_run`` and inserted here (``start``,
``start_children``); nothing else in the package inserts one.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.db import connections, transaction
from django.db.models import Model
from django.db.models.fields import AutoFieldMixin
from psycopg import sql

from .. import codes, tracing
from ..dedup import insert_values
from ..exceptions import IdempotencyConflict, InvalidInput
from ..limits import Strategy
from ..models import BudgetAccount, RunStatus, WorkflowRun
from . import budgets, clock, db, evidence, flow, interventions, seals, witness

if TYPE_CHECKING:
    from ..workflows import WorkflowDefinition


def new_run(
    definition: WorkflowDefinition,
    input: Any,
    *,
    now: dt.datetime,
    principal: Any = None,
    idempotency_key: str | None = None,
    parent: WorkflowRun | None = None,
    parent_step: int | None = None,
    child_index: int | None = None,
    trace_context: Any = None,
    **columns: Any,
) -> WorkflowRun:
    """An unsaved queued run of ``definition``, anchored and sealed.

    ``input`` and ``principal`` are JSON values already (the public entry
    points convert and check them). ``columns`` are further columns of the
    row: the flow-control fields of ``flow.start_fields``, a schedule's id and
    tick. The start seal is computed last, over the row as it will be stored.
    """
    run_id = uuid.uuid4()
    run = WorkflowRun(
        id=run_id,
        workflow_name=definition.name,
        workflow_version=definition.version,
        app_id=definition.app_id,
        status=RunStatus.QUEUED,
        input=input,
        idempotency_key=idempotency_key,
        principal=principal,
        created_at=now,
        updated_at=now,
        timeout_at=definition.timeout_at(now),
        parent=parent,
        parent_step=parent_step,
        child_index=child_index,
        root_id=(parent.root_id or parent.id) if parent is not None else run_id,
        trace_context=trace_context,
        **evidence.initial_anchors(run_id),
        **columns,
    )
    if "run_after" not in columns:
        run.run_after = now
    run.start_seal = seals.start_seal(run)
    return run


def start(
    using: str,
    definition: WorkflowDefinition,
    input: Any,
    *,
    idempotency_key: str | None = None,
    principal: Any = None,
    parent_id: uuid.UUID | None = None,
    concurrency_key: str | None = None,
    priority: int = 0,
    run_after: Any = None,
    schedule_id: str | None = None,
    scheduled_for: dt.datetime | None = None,
    queue: str = "default",
    task_path: str = "",
) -> WorkflowRun:
    """Queue a run of ``definition`` (its root's budget account with it); the same
    ``idempotency_key`` returns the run it started before.

    ``input`` and ``principal`` are JSON values. Raises ``InvalidInput`` (a bad
    flow-control argument, a missing parent) before writing anything, and
    ``IdempotencyConflict`` when the key names a run started with another
    input or by another principal. A keyed start may cancel the key's holders
    (``cancel_in_progress``) or count them under the key's lock
    (``cancel_newest``): both commit with the insert, in one transaction.
    """
    now = clock.now()
    columns = flow.start_fields(
        definition,
        concurrency_key=concurrency_key,
        priority=priority,
        run_after=run_after,
        now=now,
    )
    columns["schedule_id"] = schedule_id
    columns["scheduled_for"] = scheduled_for
    columns["queue"] = queue
    columns["task_path"] = task_path
    if concurrency_key is None:
        return _start(using, definition, input, idempotency_key, principal, parent_id, now, columns)
    with transaction.atomic(using=using):
        return _start(using, definition, input, idempotency_key, principal, parent_id, now, columns)


def _start(
    using: str,
    definition: WorkflowDefinition,
    input: Any,
    idempotency_key: str | None,
    principal: Any,
    parent_id: uuid.UUID | None,
    now: dt.datetime,
    columns: dict[str, Any],
) -> WorkflowRun:
    parent = None
    if parent_id is not None:
        parent = WorkflowRun.objects.using(using).filter(pk=parent_id).first()
        if parent is None:
            raise InvalidInput(f"parent run {parent_id} does not exist")
    run = new_run(
        definition,
        input,
        now=now,
        principal=principal,
        idempotency_key=idempotency_key,
        parent=parent,
        # The caller's W3C trace context: whichever worker runs it continues the trace.
        trace_context=tracing.capture() if tracing.ENABLED else None,
        **columns,
    )
    name = definition.name
    key = columns.get("concurrency_key")
    if key is not None and definition.concurrency is not None:
        if idempotency_key is not None:
            # A repeated start must not cancel (or be refused by) the runs of its key.
            found = existing(using, name, idempotency_key, input, principal)
            if found is not None:
                return found
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
            run.end_seal = seals.end_seal(run.id, "canceled", codes.CONCURRENCY_LIMITED, 0)
        elif strategy == Strategy.CANCEL_IN_PROGRESS:
            for holder in flow.holders_to_cancel(using, definition, key):
                interventions.cancel(
                    using,
                    holder,
                    f"canceled by a newer run with concurrency_key {key!r} (cancel_in_progress)",
                )
    budget = None
    if parent is None:
        budget = BudgetAccount(
            root_id=run.id,
            effect_budget=definition.effect_budget,
            max_ai_calls=definition.max_ai_calls,
            max_steps=definition.max_steps,
        )
    if not insert(using, run, budget):
        if idempotency_key is None:
            raise AssertionError("run was not created")
        # ON CONFLICT DO NOTHING without a target, then read by key: two
        # concurrent starts with one key never raise a unique violation.
        found = existing(using, name, idempotency_key, input, principal)
        assert found is not None
        return found
    if run.status == RunStatus.CANCELED:
        run_id = run.id
        transaction.on_commit(lambda: witness.ended(run_id, "canceled", 0, 0, None), using=using)
    if key is not None:
        # The insert's trigger admitted it to a slot, or not.
        run.holds_slot = (
            WorkflowRun.objects.using(using).filter(pk=run.id).values_list("holds_slot", flat=True)
        )[0]
    return run


def existing(
    using: str, name: str, idempotency_key: str, input: Any, principal: Any
) -> WorkflowRun | None:
    """The run ``idempotency_key`` started, if any; ``IdempotencyConflict`` when it
    was started with another input or by another principal."""
    found = (
        WorkflowRun.objects.using(using)
        .filter(workflow_name=name, idempotency_key=idempotency_key)
        .first()
    )
    if found is None:
        return None
    if found.principal != principal:
        # Neither the run nor whose it is: the key names another principal's run.
        raise IdempotencyConflict(
            f"idempotency_key {idempotency_key!r} of {name} is already used by another principal",
            None,
        )
    if found.input != input:
        raise IdempotencyConflict(
            f"idempotency_key {idempotency_key!r} already started run {found.id} "
            "with a different input",
            found.id,
        )
    return found


#: A run's row; ``{table} {columns}`` as ``dedup.insert_values`` writes them. A row
#: with the same idempotency key is left alone (nothing returned).
_INSERT_RUN_SQL = "INSERT INTO {table} {columns} ON CONFLICT DO NOTHING RETURNING id"
#: The run's row and its budget account's in one statement, the account only with the run.
_INSERT_RUN_AND_BUDGET_SQL = (
    "WITH run AS ({run}) INSERT INTO {table} {columns} FROM run RETURNING root_id"
)


def insert(using: str, run: WorkflowRun, budget: BudgetAccount | None) -> bool:
    """Insert ``run`` (and its root's budget account) in one statement; False when a
    unique constraint (the idempotency key) kept it out, and the account with it.

    One statement is one round trip, and outside a transaction one of its own:
    a start costs the caller no BEGIN and COMMIT of their own, and the two rows
    still commit together or not at all. The returned ``run`` is the row as
    stored: no column of it gets its value from the database.
    """
    connection = connections[using]
    table, columns, params = insert_values(run, connection)
    sql = _INSERT_RUN_SQL.format(table=table, columns=columns)
    if budget is not None:
        table, columns, budget_params = insert_values(budget, connection, select=True)
        sql = _INSERT_RUN_AND_BUDGET_SQL.format(run=sql, table=table, columns=columns)
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


#: The children a parent's step has created so far, by index.
CHILDREN_SQL = "SELECT child_index, id FROM k2b_run WHERE parent_id = %s AND parent_step = %s"


def start_children(
    using: str, *, parent: WorkflowRun, step: int, name: str, inputs: list[Any]
) -> list[Any]:
    """Create the children of ``parent``'s step ``step`` that do not exist yet.

    Idempotent: a replayed parent finds its children by (parent, step, index)
    and creates none twice. The caller holds the parent's fence. Raises
    ``UnknownWorkflow`` or ``budgets.BudgetExceeded`` before creating anything.
    Returns the ids of all children of that step, in input order.
    """
    from ..workflows import get_workflow

    definition = get_workflow(name)
    existing_ids = dict(db.fetchall(using, CHILDREN_SQL, [parent.id, step]))
    missing = [i for i in range(len(inputs)) if i not in existing_ids]
    budgets.reserve_children(using, root_id=parent.root_id or parent.id, count=len(missing))
    now = clock.now()
    # The creating step's span: the children's spans nest under it.
    trace_context = tracing.child_context(parent.trace_context)
    rows = [
        new_run(
            definition,
            inputs[i],
            now=now,
            principal=parent.principal,
            parent=parent,
            parent_step=step,
            child_index=i,
            trace_context=trace_context,
        )
        for i in missing
    ]
    # Under the parent's fence nobody else creates these: a conflict is a replay.
    WorkflowRun.objects.using(using).bulk_create(rows, ignore_conflicts=True)
    existing_ids.update({row.child_index: row.id for row in rows})
    return [existing_ids[i] for i in range(len(inputs))]


def start_many(
    using: str,
    definition: WorkflowDefinition,
    inputs: list[Any],
    *,
    priority: int = 0,
    run_after: Any = None,
    queue: str = "default",
    task_path: str = "",
) -> list[WorkflowRun]:
    """Queue one run of ``definition`` per input (JSON values), in one transaction.

    The runs, then their budget accounts, go in by one ``COPY`` each:
    ``enqueue_many`` of django.tasks (#37). Two statements whatever the number
    of runs, and no parameter lists to build (an ``INSERT`` of 10,000 rows of
    fifty columns spends more time binding than inserting). Each row is built
    by ``new_run`` like any other, so each is sealed and anchored; the rows'
    triggers fire as for an ``INSERT``.
    """
    now = clock.now()
    columns = flow.start_fields(
        definition, concurrency_key=None, priority=priority, run_after=run_after, now=now
    )
    columns.update(schedule_id=None, scheduled_for=None, queue=queue, task_path=task_path)
    trace_context = tracing.capture() if tracing.ENABLED else None
    runs = [
        new_run(definition, value, now=now, trace_context=trace_context, **columns)
        for value in inputs
    ]
    accounts = [
        BudgetAccount(
            root_id=run.id,
            effect_budget=definition.effect_budget,
            max_ai_calls=definition.max_ai_calls,
            max_steps=definition.max_steps,
        )
        for run in runs
    ]
    if not runs:
        return runs
    with transaction.atomic(using=using):
        copy_rows(using, runs)
        copy_rows(using, accounts)
    for obj in (*runs, *accounts):
        obj._state.adding = False
        obj._state.db = using
    return runs


_COPY_SQL = "COPY {} ({}) FROM STDIN"


def copy_rows(using: str, objs: Sequence[Model]) -> None:
    """``COPY`` ``objs`` (one model) into their table as the ORM would save them, inside
    the current transaction. Database-generated keys are left to the database."""
    connection = connections[using]
    meta = objs[0]._meta
    fields = [f for f in meta.concrete_fields if not isinstance(f, AutoFieldMixin)]
    statement = sql.SQL(_COPY_SQL).format(
        sql.Identifier(meta.db_table), sql.SQL(", ").join(sql.Identifier(f.column) for f in fields)
    )
    with (
        transaction.mark_for_rollback_on_error(using),
        connection.cursor() as cursor,
        cursor.cursor.copy(statement) as copy,
    ):
        for obj in objs:
            copy.write_row(
                [f.get_db_prep_save(f.pre_save(obj, add=True), connection) for f in fields]
            )
