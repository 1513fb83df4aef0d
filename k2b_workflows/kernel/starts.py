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

import contextlib
import datetime as dt
import json
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from django.db import connections, transaction
from django.db.models import Model
from psycopg import sql
from psycopg.types.json import Jsonb

from .. import codes, tracing
from ..dedup import insert_fields, insert_params
from ..exceptions import IdempotencyConflict, InvalidInput
from ..fairness import of_workflow_run
from ..limits import Concurrency, Strategy
from ..models import BudgetAccount, RunStatus, WorkflowRun
from . import budgets, clock, db, ended, evidence, flow, hashing, interventions, seals, uniques

if TYPE_CHECKING:
    from ..workflows import WorkflowDefinition


#: Workflow name -> the start columns its runs take from their input: the
#: django.tasks task workflows register theirs (``tasks.runs.run_columns``), so that
#: a task's run has its task's queue, priority, task path, concurrency and effect
#: budget however it is started (an enqueue, a schedule's tick, the admin's "run
#: now"), read from its sealed input rather than from whichever caller remembered
#: to pass them. A task's run is its own root: its budget account holds its task's
#: ``effect_budget`` (the key's value, when given), not its workflow's.
INPUT_COLUMNS: dict[str, Callable[[Any], dict[str, Any]]] = {}


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
    run = unsaved(
        WorkflowRun,
        {
            "id": run_id,
            "workflow_name": definition.name,
            "workflow_version": definition.version,
            "app_id": definition.app_id,
            "status": RunStatus.QUEUED,
            "input": input,
            "idempotency_key": idempotency_key,
            "principal": principal,
            "created_at": now,
            "updated_at": now,
            "timeout_at": definition.timeout_at(now),
            "parent_id": parent.id if parent is not None else None,
            "parent_step": parent_step,
            "child_index": child_index,
            "root_id": (parent.root_id or parent.id) if parent is not None else run_id,
            "trace_context": trace_context,
            # A child's run, like any other, is in its workflow's queue (#49).
            "queue": definition.queue,
            "run_after": now,
            **evidence.initial_anchors(run_id),
            **columns,
        },
    )
    if parent is not None:
        run.parent = parent  # as ``WorkflowRun(parent=parent)``: the parent is cached
    run.start_seal = seals.start_seal(run)
    return run


def unsaved(model: type[M], values: dict[str, Any]) -> M:
    """``model(**values)`` for ``values`` keyed by column attribute names (``root_id``,
    not ``root``), built as Django builds a row read back: every concrete field's
    value in order, each absent one its field's default (a callable one called).

    The same instance, in a third of the time: with keyword arguments Django's
    ``Model.__init__`` pops each of a run's sixty-odd fields from them, asks each
    absent one for its default and checks what is left over, about a fifth of an
    enqueue's CPU for the run and its budget account (#52).
    ``tests/kernel/test_dedup.py`` compares the two. A name that is no field's
    attribute is refused, as Django refuses it.
    """
    plan = _FIELDS.get(model)
    if plan is None:
        plan = _FIELDS[model] = tuple(
            (
                f.attname,
                f.default if f.has_default() and callable(f.default) else None,
                None if f.has_default() and callable(f.default) else f.get_default(),
            )
            for f in model._meta.concrete_fields
        )
    args = []
    found = 0
    for attname, factory, default in plan:
        if attname in values:
            args.append(values[attname])
            found += 1
        elif factory is not None:
            args.append(factory())
        else:
            args.append(default)
    if found != len(values):
        attnames = {attname for attname, _, _ in plan}
        unknown = sorted(name for name in values if name not in attnames)
        raise TypeError(f"{model.__name__}() got unexpected columns: {', '.join(unknown)}")
    return model(*args)


M = TypeVar("M", bound=Model)
#: Model -> each concrete field: (attname, its default's callable or None, else its default).
_FIELDS: dict[type[Model], tuple[tuple[str, Any, Any], ...]] = {}


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
    queue: str | None = None,
    task_path: str = "",
    concurrency: Concurrency | None = None,
    forked_from: uuid.UUID | None = None,
    unique: uniques.Claim | None = None,
    fairness: tuple[str, float] | None = None,
) -> WorkflowRun:
    """Queue a run of ``definition`` (its root's budget account with it); the same
    ``idempotency_key`` returns the run it started before, and a ``unique`` key held
    by a run returns that run (``kernel/uniques.py``; ``unique.matched`` says so).
    ``forked_from``: the run a fork goes on from (``forks.py``), sealed with the
    start fields. ``fairness``: the key whose turns the run takes and its weight
    (``fairness.py``), sealed with them too.

    A workflow in ``INPUT_COLUMNS`` (a django.tasks task's) takes its queue,
    priority, task path, concurrency and effect budget from its input, whoever
    starts it. Any other run is in ``queue``, or its workflow's (#49).

    ``input`` and ``principal`` are JSON values. Raises ``InvalidInput`` (a bad
    flow-control argument, a missing parent) before writing anything, and
    ``IdempotencyConflict`` when the key names a run started with another
    input or by another principal. A keyed start may cancel the key's holders
    (``cancel_in_progress``) or count them under the key's lock
    (``cancel_newest``): both commit with the insert, in one transaction.
    """
    now = clock.now()
    effect_budget = definition.effect_budget
    of_input = INPUT_COLUMNS.get(definition.name)
    if of_input is not None:
        own = of_input(input)
        queue, task_path, priority = own["queue"], own["task_path"], own["priority"]
        concurrency, concurrency_key = own["concurrency"], own["concurrency_key"]
        effect_budget = own.get("effect_budget", effect_budget)
        fairness = own.get("fairness")
    elif fairness is None:
        fairness = of_workflow_run(definition.fairness, input, None, definition.name)
    call_run_after = run_after
    if unique is not None and (run_after is None or isinstance(run_after, dt.datetime)):
        run_after = unique.first_run_after(run_after, now)
    columns = flow.start_fields(
        definition,
        concurrency_key=concurrency_key,
        priority=priority,
        run_after=run_after,
        now=now,
        concurrency=concurrency,
    )
    if unique is not None:
        columns.update(unique.columns)
    columns["schedule_id"] = schedule_id
    columns["scheduled_for"] = scheduled_for
    columns["queue"] = definition.queue if queue is None else queue
    columns["task_path"] = task_path
    if forked_from is not None:
        columns["forked_from_id"] = forked_from
    columns.update(fairness_columns(fairness))
    declared = concurrency if concurrency is not None else definition.concurrency
    args = (using, definition, input, idempotency_key, principal, parent_id, now, columns, declared)
    if unique is not None:
        # What the call would give a READY holder: its own priority and run_after.
        unique.offer = (columns["priority"], call_run_after)
    if concurrency_key is None:
        return _start(*args, effect_budget, unique)
    with transaction.atomic(using=using):
        return _start(*args, effect_budget, unique)


def fairness_columns(fairness: tuple[str, float] | None) -> dict[str, Any]:
    """The columns of a run that takes turns by ``fairness`` (key, weight); none for
    one that does not (its row keeps the defaults: no key, weight 1)."""
    if fairness is None:
        return {}
    key, weight = fairness
    return {"fairness_key": key, "fairness_weight": weight}


def _start(
    using: str,
    definition: WorkflowDefinition,
    input: Any,
    idempotency_key: str | None,
    principal: Any,
    parent_id: uuid.UUID | None,
    now: dt.datetime,
    columns: dict[str, Any],
    declared: Concurrency | None,
    effect_budget: dict[str, int],
    unique: uniques.Claim | None = None,
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
    if key is not None and declared is not None:
        if idempotency_key is not None:
            # A repeated start must not cancel (or be refused by) the runs of its key.
            found = existing(using, name, idempotency_key, input, principal)
            if found is not None:
                return found
        strategy = declared.strategy
        if strategy == Strategy.CANCEL_NEWEST and not flow.has_room(
            using, definition, key, declared.limit
        ):
            run.status = RunStatus.CANCELED
            run.error_code = codes.CONCURRENCY_LIMITED
            run.error_message = (
                f"concurrency_key {key!r} already has {declared.limit} "
                "active run(s) (cancel_newest)"
            )
            run.finished_at = now
            # Born ended: sealed and told as every end is (kernel/ended.py).
            run.end_seal = ended.seal(run.id, "canceled", codes.CONCURRENCY_LIMITED, 0)
        elif strategy == Strategy.CANCEL_IN_PROGRESS:
            for holder in flow.holders_to_cancel(using, definition, key, declared.limit):
                interventions.cancel(
                    using,
                    holder,
                    f"canceled by a newer run with concurrency_key {key!r} (cancel_in_progress)",
                )
    budget = None
    if parent is None:
        budget = unsaved(
            BudgetAccount,
            {
                "root_id": run.id,
                "effect_budget": effect_budget,
                "max_ai_calls": definition.max_ai_calls,
                "max_steps": definition.max_steps,
                "limits_seal": seals.limits_seal(
                    run.id, effect_budget, definition.max_ai_calls, definition.max_steps
                ),
            },
        )
    rounds = 0
    while not insert(using, run, budget):
        # ON CONFLICT DO NOTHING without a target, then read by key: two
        # concurrent starts with one key never raise a unique violation.
        found = None
        if idempotency_key is not None:
            found = existing(using, name, idempotency_key, input, principal)
        if found is None and unique is not None:
            found = _unique_holder(using, unique, input, now)
        if found is not None:
            return found
        rounds += 1
        if unique is None or rounds >= uniques.MAX_ROUNDS:
            raise AssertionError("run was not created")
    if run.status == RunStatus.CANCELED:
        ended.told(
            using,
            run_id=run.id,
            workflow_name=run.workflow_name,
            status="canceled",
            error_code=codes.CONCURRENCY_LIMITED,
            generation=0,
        )
    if key is not None:
        # The insert's trigger admitted it to a slot, or not.
        run.holds_slot = (
            WorkflowRun.objects.using(using).filter(pk=run.id).values_list("holds_slot", flat=True)
        )[0]
    return run


def _unique_holder(
    using: str, unique: uniques.Claim, input: Any, now: dt.datetime
) -> WorkflowRun | None:
    """The run holding ``unique``'s key, changed by a replace or debounce call; None:
    nobody holds it now (it ended, or let it go), so the start inserts again."""
    found = uniques.holder(using, unique, now)
    if found is None:
        return None
    priority, run_after = unique.offer
    unique.matched = uniques.change(
        using, found, unique, input=input, priority=priority, run_after=run_after, now=now
    )
    return unique.matched


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


#: A run's row; a row with the same idempotency key is left alone (nothing returned).
_INSERT_RUN_SQL = (
    "INSERT INTO {table} ({columns}) VALUES ({values}) ON CONFLICT DO NOTHING RETURNING id"
)
#: The run's row and its budget account's in one statement, the account only with the run.
_INSERT_RUN_AND_BUDGET_SQL = (
    "WITH run AS ({run}) INSERT INTO {table} ({columns}) SELECT {values} FROM run RETURNING root_id"
)


def insert(using: str, run: WorkflowRun, budget: BudgetAccount | None) -> bool:
    """Insert ``run`` (and its root's budget account) in one statement; False when a
    unique constraint (the idempotency key) kept it out, and the account with it.

    One statement is one round trip, and outside a transaction one of its own:
    a start costs the caller no BEGIN and COMMIT of their own, and the two rows
    still commit together or not at all. The returned ``run`` is the row as
    stored: no column of it gets its value from the database.

    Every column is written as the ORM would save it; a NULL one as the literal
    ``NULL`` in the statement rather than a parameter (#37). Each enqueue is one
    of these: with fifty-odd parameters psycopg parsed the statement again on
    every call (it caches statements of at most 50), the largest share of an
    enqueue's own CPU time. A task run has some twenty NULL columns: the
    statement text is the same from one enqueue to the next, and parsed once.
    """
    connection = connections[using]
    params = insert_params(run, connection)
    nulls = tuple([value is None for value in params])
    budget_nulls = None
    if budget is not None:
        budget_params = insert_params(budget, connection)
        budget_nulls = tuple([value is None for value in budget_params])
        params = [*params, *budget_params]
    sql = _insert_sql(connection, nulls, budget_nulls)
    params = [value for value in params if value is not None]
    # As Django's own saves: an error inside the caller's atomic block marks it
    # for rollback, so their next query says so instead of failing obscurely.
    # Through the kernel's statement cursor (``db.statement_cursor``), not Django's:
    # on a connection that prepares statements the insert is parsed and planned
    # once per connection, and its parameters are dumped by psycopg's C code rather
    # than quoted into its text in Python (#52).
    with transaction.mark_for_rollback_on_error(using):
        created = bool(db.fetch_statement(using, sql, params))
    for obj in (run, budget):
        if obj is not None and created:
            obj._state.adding = False
            obj._state.db = using
    return created


#: (NULL columns of the run, of its budget account) -> the insert statement. A few
#: patterns in all (a task run, a child, a keyed start...); every PostgreSQL
#: connection quotes names alike, so one text serves them all.
_INSERT_SQL: dict[tuple[tuple[bool, ...], tuple[bool, ...] | None], str] = {}


def _insert_sql(
    connection: Any, nulls: tuple[bool, ...], budget_nulls: tuple[bool, ...] | None
) -> str:
    """The insert of a run (and its budget account) whose columns ``nulls`` (and
    ``budget_nulls``) are NULL: those as literals, every other one a parameter."""
    key = (nulls, budget_nulls)
    sql = _INSERT_SQL.get(key)
    if sql is None:
        quote = connection.ops.quote_name
        sql = _INSERT_RUN_SQL.format(**_insert_parts(quote, WorkflowRun, nulls))
        if budget_nulls is not None:
            parts = _insert_parts(quote, BudgetAccount, budget_nulls)
            sql = _INSERT_RUN_AND_BUDGET_SQL.format(run=sql, **parts)
        _INSERT_SQL[key] = sql
    return sql


def _insert_parts(
    quote: Callable[[str], str], model: type[Model], nulls: tuple[bool, ...]
) -> dict[str, str]:
    fields = insert_fields(model)
    if len(fields) != len(nulls):
        raise AssertionError(f"{model.__name__} has {len(fields)} columns, not {len(nulls)}")
    return {
        "table": quote(model._meta.db_table),
        "columns": ", ".join(quote(f.column) for f in fields),
        "values": ", ".join("NULL" if null else "%s" for null in nulls),
    }


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
            **fairness_columns(
                of_workflow_run(definition.fairness, inputs[i], None, definition.name)
            ),
        )
        for i in missing
    ]
    # Under the parent's fence nobody else creates these: a conflict is a replay.
    WorkflowRun.objects.using(using).bulk_create(rows, ignore_conflicts=True)
    existing_ids.update({row.child_index: row.id for row in rows})
    return [existing_ids[i] for i in range(len(inputs))]


class QueuedRun(NamedTuple):
    """A run ``start_many`` queued: what a caller of a bulk start reads back of it."""

    pk: uuid.UUID
    created_at: dt.datetime


#: The columns in which the runs of one ``start_many`` differ: everything else is
#: the same in every row, taken from one run ``new_run`` built.
PER_RUN_COLUMNS = ("id", "root_id", "input", "start_seal", "journal_anchor", "ledger_anchor")


def start_many(
    using: str,
    definition: WorkflowDefinition,
    inputs: list[Any],
    *,
    priority: int = 0,
    run_after: Any = None,
    queue: str | None = None,
    task_path: str = "",
) -> list[QueuedRun]:
    """Queue one run of ``definition`` per input (JSON values), in one transaction.

    The runs, then their budget accounts, go in by one ``COPY`` each:
    ``enqueue_many`` of django.tasks (#37). Two statements whatever the number
    of runs (and ``IGNORE_NOTHING_SQL`` before them, for the triggers' sake),
    and no parameter lists to build (an ``INSERT`` of 10,000 rows of fifty
    columns spends more time binding than inserting).

    Nor a model instance per run: ``new_run`` builds one run (sealed and
    anchored as any other), and every row is that run's prepared columns with
    its own id, input, start seal and chain anchors (``PER_RUN_COLUMNS``),
    computed as ``new_run`` computes them. Both are checked on each call: two
    runs ``new_run`` builds differ only in those columns, and the first row
    as built here is the row ``new_run`` built. A column added to ``new_run``
    that differs per run, or a seal computed another way, fails here rather
    than writing rows a claim would refuse. The rows' triggers fire as for an
    ``INSERT``.
    """
    if not inputs:
        return []
    now = clock.now()
    concurrency, concurrency_key, fairness = None, None, None
    effect_budget = definition.effect_budget
    of_input = INPUT_COLUMNS.get(definition.name)
    if of_input is not None:
        # The inputs of one task's calls: they differ in the call's arguments only.
        own = of_input(inputs[0])
        queue, task_path, priority = own["queue"], own["task_path"], own["priority"]
        concurrency, concurrency_key = own["concurrency"], own["concurrency_key"]
        effect_budget = own.get("effect_budget", effect_budget)
        fairness = own.get("fairness")
        if concurrency is not None and concurrency.strategy != Strategy.QUEUE:
            raise InvalidInput(
                f"concurrency strategy {concurrency.strategy.value!r} decides each start "
                "against the runs before it: start them one by one"
            )
    columns = flow.start_fields(
        definition,
        concurrency_key=concurrency_key,
        priority=priority,
        run_after=run_after,
        now=now,
        concurrency=concurrency,
    )
    columns.update(
        schedule_id=None,
        scheduled_for=None,
        queue=definition.queue if queue is None else queue,
        task_path=task_path,
        **fairness_columns(fairness),
    )
    trace_context = tracing.capture() if tracing.ENABLED else None
    template = new_run(definition, inputs[0], now=now, trace_context=trace_context, **columns)
    other = new_run(definition, inputs[0], now=now, trace_context=trace_context, **columns)
    connection = connections[using]
    fields = insert_fields(WorkflowRun)
    names = [f.attname for f in fields]
    prepared = insert_params(template, connection)
    other_values = _dumped(insert_params(other, connection), connection)
    differing = {
        name
        for name, a, b in zip(names, _dumped(prepared, connection), other_values, strict=True)
        if a != b
    }
    if not differing <= set(PER_RUN_COLUMNS):
        raise AssertionError(
            f"new_run() builds runs that differ in {sorted(differing - set(PER_RUN_COLUMNS))}: "
            "start_many() would copy one run's value into every row"
        )
    at = {name: names.index(name) for name in PER_RUN_COLUMNS}
    input_field = fields[at["input"]]
    key_id, key = hashing.signing_key()

    # A task taking turns (``Fairness``): each call's key is in its input, so that a
    # re-enqueue or a schedule's tick takes the same turns.
    fair_at = (names.index("fairness_key"), names.index("fairness_weight"))

    def row(run_id: uuid.UUID, value: Any) -> list[Any]:
        values = list(prepared)
        values[at["id"]] = values[at["root_id"]] = run_id
        values[at["input"]] = input_field.get_db_prep_save(value, connection)
        own_fairness = None
        if fairness is not None and of_input is not None:
            own_fairness = of_input(value).get("fairness")
            values[fair_at[0]], values[fair_at[1]] = own_fairness or (None, 1.0)
        values[at["start_seal"]] = seals.start_seal_like(
            template, run_id, value, fairness=own_fairness
        )
        values[at["journal_anchor"]] = evidence.anchor(
            run_id, "journal", 0, evidence.GENESIS, key_id, key
        )
        values[at["ledger_anchor"]] = evidence.anchor(
            run_id, "ledger", 0, evidence.GENESIS, key_id, key
        )
        return values

    if _dumped(row(template.pk, template.input), connection) != _dumped(prepared, connection):
        raise AssertionError("start_many() builds a row other than new_run() builds")
    account_fields = insert_fields(BudgetAccount)
    account = insert_params(
        BudgetAccount(
            root_id=template.pk,
            effect_budget=effect_budget,
            max_ai_calls=definition.max_ai_calls,
            max_steps=definition.max_steps,
        ),
        connection,
    )
    account_names = [f.attname for f in account_fields]
    root_at = account_names.index("root_id")
    limits_at = account_names.index("limits_seal")
    # The same JSON in every row: dumped once, not once per row (COPY reads text).
    for values in (prepared, account):
        for i, value in enumerate(values):
            if isinstance(value, Jsonb):
                values[i] = (value.dumps or json.dumps)(value.obj)
    ids = [uuid.uuid4() for _ in inputs]
    with transaction.atomic(using=using):
        db.execute(using, IGNORE_NOTHING_SQL)
        with _copy(using, WorkflowRun, fields) as copy:
            for run_id, value in zip(ids, inputs, strict=True):
                copy.write_row(row(run_id, value))
        with _copy(using, BudgetAccount, account_fields) as copy:
            for run_id in ids:
                account[root_at] = run_id
                account[limits_at] = seals.limits_seal(
                    run_id, effect_budget, definition.max_ai_calls, definition.max_steps
                )
                copy.write_row(account)
    return [QueuedRun(run_id, now) for run_id in ids]


_COPY_SQL = "COPY {} ({}) FROM STDIN"

#: ``pgtrigger.ignore`` set to the empty list, unless the transaction has a list of
#: its own: no trigger is ignored either way. Every trigger of the app first asks
#: pgtrigger's ``_pgtrigger_should_ignore``, which reads the setting as an array
#: inside an exception block; unset (or empty), reading it raises, and catching that
#: is most of what the queued run's NOTIFY trigger costs: 130 us a row, 1.3 s of a
#: 10,000-run ``COPY``, against 0.1 s once the setting reads as ``{}`` (#37).
#: Local to the transaction: it ends with it.
IGNORE_NOTHING_SQL = (
    "SELECT pg_catalog.set_config('pgtrigger.ignore', '{}', true)"
    " WHERE NULLIF(pg_catalog.current_setting('pgtrigger.ignore', true), '') IS NULL"
)


def _dumped(values: list[Any], connection: Any) -> list[Any]:
    """Prepared columns as text, to compare two rows (a ``Jsonb`` has no equality)."""
    return [json.dumps(v.obj, sort_keys=True) if isinstance(v, Jsonb) else str(v) for v in values]


@contextlib.contextmanager
def _copy(using: str, model: type[Model], fields: Sequence[Any]) -> Iterator[Any]:
    """A ``COPY`` into ``model``'s table inside the current transaction."""
    connection = connections[using]
    statement = sql.SQL(_COPY_SQL).format(
        sql.Identifier(model._meta.db_table),
        sql.SQL(", ").join(sql.Identifier(f.column) for f in fields),
    )
    with (
        transaction.mark_for_rollback_on_error(using),
        connection.cursor() as cursor,
        cursor.cursor.copy(statement) as copy,
    ):
        yield copy
