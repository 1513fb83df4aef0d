"""``manage.py workflowschedules``: every schedule, its state and its next ticks."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from k2b_workflows import naming, settings
from k2b_workflows.exceptions import InvalidInput
from k2b_workflows.kernel import db, schedule_passes
from k2b_workflows.management import arguments
from k2b_workflows.management.commands.workflowruns import format_table
from k2b_workflows.models import WorkflowSchedule


def _when(value: Any) -> str:
    return "-" if value is None else timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S%z")


def describe(row: WorkflowSchedule) -> str:
    return f"cron {row.cron} ({row.timezone})" if row.cron else f"every {row.every}"


def state(row: WorkflowSchedule) -> str:
    if row.seal_problem() is not None:
        return "tampered"
    if not row.enabled:
        return "disabled"
    return "paused" if row.paused else "active"


def next_ticks(row: WorkflowSchedule, count: int) -> list[Any]:
    """The row's next ``count`` ticks from its next tick on (none while disabled)."""
    if not row.enabled or row.next_tick is None or count <= 0:
        return []
    try:
        spec = row.spec()
    except InvalidInput:
        return []
    ticks = [row.next_tick]
    while len(ticks) < count:
        ticks.append(spec.next_tick(ticks[-1], row.anchor))
    return ticks


class Command(BaseCommand):
    help = "List the workflow schedules with their state, last tick and next ticks."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--next",
            type=arguments.integer(0, 100),
            default=3,
            metavar="N",
            help="next ticks shown per schedule (default 3)",
        )
        parser.add_argument("--json", action="store_true", help="print one JSON object")

    def handle(self, *args: Any, **options: Any) -> None:
        using = settings.database()
        try:
            with db.schema_required():
                rows = list(WorkflowSchedule.objects.using(using).order_by("schedule_id"))
                late = {r[0] for r in schedule_passes.late(using)}
        except InvalidInput as exc:
            raise CommandError(str(exc)) from exc
        count = options["next"]
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    [
                        {
                            "schedule_id": r.schedule_id,
                            "workflow": r.workflow_name,
                            "task": naming.input_task_path(r.input),
                            "version": r.workflow_version,
                            "spec": describe(r),
                            "state": state(r),
                            "late": r.schedule_id in late,
                            "disabled_reason": r.disabled_reason,
                            "last_tick": r.last_tick and r.last_tick.isoformat(),
                            "next_ticks": [t.isoformat() for t in next_ticks(r, count)],
                        }
                        for r in rows
                    ],
                    indent=2,
                )
            )
            return
        if not rows:
            self.stdout.write("no schedules")
            return
        table = [
            [
                r.schedule_id,
                r.display_name + (f" v{r.workflow_version}" if r.workflow_version else ""),
                describe(r),
                state(r) + (" LATE" if r.schedule_id in late else ""),
                _when(r.last_tick),
                ", ".join(_when(t) for t in next_ticks(r, count)) or "-",
            ]
            for r in rows
        ]
        self.stdout.write(
            format_table(["SCHEDULE", "WORKFLOW", "SPEC", "STATE", "LAST TICK", "NEXT"], table)
        )
        for r in rows:
            if not r.enabled:
                self.stdout.write(f"{r.schedule_id}: disabled: {r.disabled_reason}")
