"""``manage.py verifyworkflows``: check every run's evidence chains and anchors.

Finished runs included: a run is verified by the kernel only while it runs,
and an edited resolution on a run that ended a year ago is still a lie.
Exits non-zero when any run is broken, so it can gate a backup or a cron job.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from k2b_workflows import store
from k2b_workflows.kernel.evidence import verify_chains, verify_run
from k2b_workflows.models import JournalEntry, LedgerEntry, WorkflowRun


class Command(BaseCommand):
    help = (
        "Verify the keyed journal and ledger chains and the anchors of every run, in batches; "
        "print each broken run (id, entry, why) and exit non-zero if there is one."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--batch", type=int, default=500, help="runs read per batch")
        parser.add_argument("--database", default=None, help="alias (default: DATABASE)")

    def handle(self, *args: Any, batch: int, database: str | None, **options: Any) -> None:
        if batch <= 0:
            raise CommandError("--batch must be positive")
        using = database or store.database()
        checked = broken = 0
        after = None
        while True:
            runs = WorkflowRun.objects.using(using).order_by("id")
            if after is not None:
                runs = runs.filter(id__gt=after)
            page = list(runs[:batch])
            if not page:
                break
            ids = [run.pk for run in page]
            journals: dict[Any, list[JournalEntry]] = {pk: [] for pk in ids}
            ledgers: dict[Any, list[LedgerEntry]] = {pk: [] for pk in ids}
            for entry in (
                JournalEntry.objects.using(using).filter(run_id__in=ids).order_by("run_id", "seq")
            ):
                journals[entry.run_id].append(entry)
            for entry in LedgerEntry.objects.using(using).filter(run_id__in=ids).order_by("id"):
                ledgers[entry.run_id].append(entry)
            for run in page:
                problem = verify_run(run, journals[run.pk], ledgers[run.pk])
                if problem is not None:
                    # The batch was read without locks: a live run may have appended
                    # between two reads. Only a break seen under its lock counts.
                    problem = verify_chains(run.pk, using)
                if problem is not None:
                    broken += 1
                    self.stdout.write(
                        f"BROKEN {run.pk} {run.workflow_name} ({run.status}): {problem}"
                    )
            checked += len(page)
            after = page[-1].pk
        summary = f"verified {checked} runs: {broken} broken"
        if broken:
            raise CommandError(summary)
        self.stdout.write(summary)
