"""``manage.py workflowruns``: list runs, and what each waiting run waits for."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from k2b_workflows import settings
from k2b_workflows.exceptions import DatabaseNotMigrated
from k2b_workflows.kernel import clock, db
from k2b_workflows.management import arguments
from k2b_workflows.models import RunStatus, WorkflowRun
from k2b_workflows.versions import live_pairs, run_code_note

#: A listing longer than this is not read; ``--limit`` past ``bigint`` would fail in SQL.
MAX_LIMIT = 1_000_000


def _when(value: Any) -> str:
    if value is None:
        return "-"
    return timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S")


def _ago(value: Any, now: Any) -> str:
    """``3m12s`` since ``value``: how long a run has been waiting, at a glance."""
    if value is None:
        return "-"
    seconds = max(0, int((now - value).total_seconds()))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns as wide as their widest cell, a rule under the header."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )
    return "\n".join(lines)


class Command(BaseCommand):
    help = (
        "List workflow runs, newest first. --waiting shows what each waiting run waits for: "
        "kind, key, deadline and since when."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--status",
            action="append",
            dest="statuses",
            metavar="STATUS",
            choices=RunStatus.values,
            help="only runs with this status (repeatable)",
        )
        parser.add_argument(
            "--app",
            action="append",
            dest="apps",
            metavar="APP",
            type=arguments.text(100),
            help="only runs of this app id (repeatable)",
        )
        parser.add_argument(
            "--waiting",
            action="store_true",
            help="only waiting runs, with their dependency; longest waiting first",
        )
        parser.add_argument(
            "--limit",
            type=arguments.integer(0, MAX_LIMIT),
            default=50,
            help=f"at most this many runs (default 50; 0 = all; at most {MAX_LIMIT})",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            with db.schema_required():
                self._list(**options)
        except DatabaseNotMigrated as exc:
            raise CommandError(str(exc), returncode=2) from None

    def _list(
        self,
        *args: Any,
        statuses: list[str] | None,
        apps: list[str] | None,
        waiting: bool,
        limit: int,
        **options: Any,
    ) -> None:
        runs = WorkflowRun.objects.using(settings.database()).all()
        if waiting:
            if statuses and statuses != [RunStatus.WAITING]:
                raise CommandError("--waiting lists waiting runs only; drop --status")
            runs = runs.filter(status=RunStatus.WAITING).order_by("waiting_since")
        elif statuses:
            runs = runs.filter(status__in=statuses)
        if apps:
            runs = runs.filter(app_id__in=apps)
        total = runs.count()
        if limit:
            runs = runs[:limit]
        now = clock.now()
        listed = list(runs)
        # A queued run pinned to a version no live worker has would wait silently.
        live = live_pairs(settings.database())
        notes = [(r, run_code_note(r, live=live)) for r in listed if r.status == RunStatus.QUEUED]
        if waiting:
            headers = [
                "RUN",
                "APP",
                "WORKFLOW",
                "STEP",
                "KIND",
                "KEY",
                "DEADLINE",
                "WAITING SINCE",
                "FOR",
            ]
            rows = [
                [
                    str(r.id),
                    r.app_id,
                    r.display_name,
                    "-" if r.wait_step is None else str(r.wait_step),
                    r.wait_kind,
                    r.wait_key,
                    _when(r.wait_deadline),
                    _when(r.waiting_since),
                    _ago(r.waiting_since, now),
                ]
                for r in listed
            ]
        else:
            headers = [
                "RUN",
                "APP",
                "WORKFLOW",
                "VER",
                "STATUS",
                "GEN",
                "STEP",
                "ERROR",
                "CREATED",
                "UPDATED",
            ]
            rows = [
                [
                    str(r.id),
                    r.app_id,
                    r.display_name,
                    str(r.workflow_version),
                    r.status,
                    str(r.generation),
                    "-" if r.current_step is None else str(r.current_step),
                    r.error_code or "-",
                    _when(r.created_at),
                    _when(r.updated_at),
                ]
                for r in listed
            ]
        if not rows:
            self.stdout.write("no waiting runs" if waiting else "no runs")
            return
        # Keys, names and messages come from users and providers: never raw to a terminal.
        rows = [[arguments.printable(cell) for cell in row] for row in rows]
        self.stdout.write(format_table(headers, rows))
        if total > len(rows):
            self.stdout.write(f"({len(rows)} of {total}; --limit 0 shows all)")
        for run, note in notes:
            if note:
                self.stdout.write(
                    f"run {run.id} ({run.display_name} v{run.workflow_version}): {note}"
                )
