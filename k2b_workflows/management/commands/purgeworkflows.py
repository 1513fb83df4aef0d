"""``manage.py purgeworkflows``: retention for finished run trees, old wait rendezvous and
the rows of workers that stopped or were lost."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from k2b_workflows import fleet
from k2b_workflows.kernel import clock
from k2b_workflows.management import arguments
from k2b_workflows.models import WorkerRecord
from k2b_workflows.retention import purge_finished_runs

#: A century: anything longer is a typo (and ``timedelta`` overflows past 999,999,999 days).
MAX_DAYS = 36_500
#: One transaction deleting more trees than this holds locks for too long.
MAX_BATCH = 100_000


class Command(BaseCommand):
    help = (
        "Delete run trees whose every run ended more than --older-than-days ago, with their "
        "journal, ledger and charges. Runs that need attention are never deleted, nor members of "
        "a batch whose callbacks have not been enqueued. Then task batches as old whose members "
        "and callbacks' runs are all deleted. Also deletes "
        "rows of stopped or lost workers whose last heartbeat is as old."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than-days",
            type=arguments.number(0, MAX_DAYS),
            required=True,
            help=f"age of the run trees to delete, in days (above 0, at most {MAX_DAYS})",
        )
        parser.add_argument(
            "--batch",
            type=arguments.integer(1, MAX_BATCH),
            default=1000,
            help=f"run trees per transaction (1 to {MAX_BATCH})",
        )
        parser.add_argument("--dry-run", action="store_true", help="count, delete nothing")

    def handle(
        self, *args: Any, older_than_days: float, batch: int, dry_run: bool, **options: Any
    ) -> None:
        older_than = dt.timedelta(days=older_than_days)
        total: dict[str, int] = {}
        while True:
            counts = purge_finished_runs(older_than=older_than, batch=batch, dry_run=dry_run)
            for key, value in counts.items():
                total[key] = total.get(key, 0) + value
            if dry_run or max(counts["run trees"], counts["task batches"]) < batch:
                break
        if dry_run:
            total["worker rows"] = WorkerRecord.objects.filter(
                state__in=["stopped", "lost"], heartbeat_at__lt=clock.now() - older_than
            ).count()
        else:
            fleet.mark_lost()
            total["worker rows"] = fleet.purge(older_than_ms=int(older_than.total_seconds() * 1000))
        verb = "would delete" if dry_run else "deleted"
        self.stdout.write(f"{verb}: " + ", ".join(f"{n} {label}" for label, n in total.items()))
