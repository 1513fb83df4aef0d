"""Defining, changing and running schedules: what user code, ``migrate`` and the admin call.

The failure this module guards against: a schedule that fires code nobody
meant to fire any more. A decorator's schedule lives in the database (the
passes of every worker read it there), so removing ``schedule=`` from a
``@workflow`` must reach that row: ``migrate`` writes every decorator's
schedule and *disables* the rows of decorators that no longer declare one,
with the reason on its admin page, instead of leaving them firing.
``schedule_workflow`` refuses what it cannot start (an unknown workflow or
version, a malformed spec) before writing anything.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import IntegrityError, router, transaction

from . import settings, validation
from .control import start_workflow_run
from .exceptions import InvalidInput, InvalidSchedule
from .models import WorkflowRun, WorkflowSchedule
from .models.schedules import NOW_SQL
from .schedules import SCHEDULED_FOR, Schedule, iso
from .workflows import get_workflow, registered_workflows

logger = logging.getLogger(__name__)

#: Why ``migrate`` disabled a decorator's schedule.
REMOVED_FROM_DECORATOR = "the @workflow decorator no longer declares this schedule"


def schedule_workflow(
    schedule_id: str, workflow_name: str, schedule: Schedule, *, version: int | None = None
) -> WorkflowSchedule:
    """Create or update the schedule ``schedule_id`` that starts ``workflow_name``.

    ``version`` pins the runs to one registered version (default: the newest
    registered in the worker that fires the tick). Changing the spec starts
    the ticks afresh after now; ``paused`` is left as it is. Raises
    ``InvalidSchedule`` / ``InvalidInput`` / ``UnknownWorkflow`` naming what
    is wrong, before writing anything.
    """
    validation.text(schedule_id, "schedule_id", max_length=200)
    if not schedule_id.strip():
        raise InvalidSchedule("schedule_id must not be blank", field="schedule_id")
    if not isinstance(schedule, Schedule):
        raise InvalidSchedule(
            f"schedule_workflow() takes a Schedule(...), not {type(schedule).__name__}",
            field="schedule",
        )
    validation.text(workflow_name, "the workflow name", max_length=200)
    validation.integer(version, "version", minimum=1, maximum=validation.MAX_INT, optional=True)
    get_workflow(workflow_name, version)
    using = settings.database()
    for attempt in range(2):
        try:
            with transaction.atomic(using=using):
                row = (
                    WorkflowSchedule.objects.using(using)
                    .select_for_update()
                    .filter(schedule_id=schedule_id)
                    .first()
                )
                if row is not None and row.source == WorkflowSchedule.Source.DECORATOR:
                    raise InvalidSchedule(
                        f"schedule_id {schedule_id!r} is the schedule of @workflow({schedule_id!r},"
                        " schedule=...): change it there",
                        field="schedule_id",
                    )
                row = row or WorkflowSchedule(schedule_id=schedule_id)
                apply_spec(row, workflow_name, schedule, version)
                row.source = row.source or WorkflowSchedule.Source.CODE
                row.reviewed = True  # the whole spec is the caller's: a tampered row is rewritten
                row.save(using=using)
                return row
        except IntegrityError:
            if attempt:
                raise  # a concurrent call created it: the second attempt updates it
    raise AssertionError("unreachable")


def apply_spec(
    row: WorkflowSchedule, workflow_name: str, schedule: Schedule, version: int | None
) -> None:
    """Copy ``schedule`` onto ``row`` (unsaved)."""
    row.workflow_name = workflow_name
    row.workflow_version = version
    row.cron = schedule.cron or ""
    row.every = schedule.every
    row.timezone = schedule.timezone
    row.input = schedule.input
    row.catch_up = schedule.catch_up
    row.overlap = schedule.overlap
    row.jitter = schedule.jitter


def run_schedule_now(row: WorkflowSchedule) -> WorkflowRun:
    """Start one run of ``row`` now, outside its ticks (the admin's "run now").

    Its ``scheduled_for`` is now (the database's clock) and its key
    ``schedule:<id>:now:<time>``; overlap is not consulted (an operator asked)
    and the ticks are left as they are.
    """
    row.refresh_from_db()  # what it starts is what is stored now, and sealed
    tampered = row.seal_problem()
    if tampered is not None:
        raise InvalidInput(f"schedule {row.schedule_id!r} was not run: {tampered}")
    if not row.enabled:
        raise InvalidInput(f"schedule {row.schedule_id!r} is disabled: {row.disabled_reason}")
    row.spec()
    using = settings.database()
    from .kernel import db

    now = db.fetchall(using, NOW_SQL)[0][0]
    return start_workflow_run(
        row.workflow_name,
        {**row.input, SCHEDULED_FOR: iso(now)},
        idempotency_key=f"schedule:{row.schedule_id}:now:{iso(now)}",
        version=row.workflow_version,
        schedule_id=row.schedule_id,
        scheduled_for=now,
    )


def sync_decorator_schedules(using: str | None = None, **kwargs: Any) -> dict[str, int]:
    """Write every ``@workflow(schedule=...)`` as its schedule; disable the removed ones.

    Connected to ``post_migrate``: ``migrate`` runs it where every app's
    workflows are registered. Returns counts (written, disabled).
    """
    using = using or settings.database()
    if not router.allow_migrate_model(using, WorkflowSchedule):
        return {"written": 0, "disabled": 0}
    declared = {
        name: definition
        for name, definition in registered_workflows().items()
        if definition.schedule is not None
    }
    written = disabled = 0
    with transaction.atomic(using=using):
        rows = {
            r.schedule_id: r
            for r in WorkflowSchedule.objects.using(using)
            .select_for_update()
            .filter(schedule_id__in=list(declared))
        }
        for name, definition in declared.items():
            assert definition.schedule is not None
            row = rows.get(name) or WorkflowSchedule(schedule_id=name)
            before = _spec_tuple(row) if not row._state.adding else None
            apply_spec(row, name, definition.schedule, None)
            tampered = not row._state.adding and row.seal_problem() is not None
            if (
                before == _spec_tuple(row)
                and row.enabled
                and row.source == "decorator"
                and not tampered
            ):
                continue
            if tampered:
                logger.warning(
                    "schedule %s was not written by the key holder: written again from its"
                    " decorator, its ticks start afresh",
                    name,
                )
            row.source = WorkflowSchedule.Source.DECORATOR
            row.enabled, row.disabled_reason = True, ""
            row.reviewed = True  # the whole spec is the decorator's
            row.save(using=using)
            written += 1
        for row in (
            WorkflowSchedule.objects.using(using)
            .select_for_update()
            .filter(source=WorkflowSchedule.Source.DECORATOR, enabled=True)
            .exclude(schedule_id__in=list(declared))
        ):
            row.enabled, row.disabled_reason = False, REMOVED_FROM_DECORATOR
            row.reviewed = True  # disabled: whatever it holds, it fires nothing
            row.save(using=using)
            logger.warning("schedule %s disabled: %s", row.schedule_id, REMOVED_FROM_DECORATOR)
            disabled += 1
    return {"written": written, "disabled": disabled}


def _spec_tuple(row: WorkflowSchedule) -> tuple[Any, ...]:
    return (
        row.workflow_name,
        row.workflow_version,
        row.cron,
        row.every,
        row.timezone,
        row.input,
        row.catch_up,
        row.overlap,
        row.jitter,
    )


def post_migrate(sender: Any, using: str = "default", **kwargs: Any) -> None:
    """``post_migrate`` of this app, after a ``migrate`` of the kernel's database to a
    state that has the schedule table, or after a ``flush`` of it.

    ``flush`` sends the signal too (without a ``plan``): a transactional test case
    flushes the test database after each test, and the decorators' schedules,
    emptied with every other table, are written again, as ``migrate`` first
    wrote them. The next test sees the database as ``migrate`` left it (#38).
    """
    if using not in (settings.database(), settings.owner_database()):
        return
    state = kwargs.get("apps")
    if state is not None:
        try:
            state.get_model("k2b_workflows", "WorkflowSchedule")
        except LookupError:
            return  # migrated back to before the table existed
    counts = sync_decorator_schedules(using)
    if any(counts.values()) and kwargs.get("verbosity", 1) >= 1:
        print(
            f"  k2b_workflows: {counts['written']} decorator schedule(s) written,"
            f" {counts['disabled']} disabled"
        )
