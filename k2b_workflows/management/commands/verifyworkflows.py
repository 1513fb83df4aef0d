"""``manage.py verifyworkflows``: check every run's evidence: chains, anchors and seals.

And every schedule row's seal: a row the runtime role wrote or edited fires
nothing (``kernel/schedule_seals.py``), and is named here. And the
flow-control and budget state no kernel path leaves behind: a key with more
slot holders than its limit, a slot held by an ended run or without a key, a
budget whose spending is not its charges' sum (``kernel/flow_audit.py``).
And every django.tasks attempt row: one whose seal does not verify, or a
copy of a sealed one (``tasks.runs.checked_attempts``), is named with its run.

Finished runs included: a run is verified by the kernel only while it runs,
and an edited resolution on a run that ended a year ago is still a lie.
``--witness FILE`` also holds the database against the witness records
shipped out of it (``kernel/witness.py``): a run deleted, rolled back or
restored from a backup is found there and nowhere else.
Exits non-zero when anything is broken, so it can gate a backup or a cron job.
Reads only: a read-only auditor role can run it.
"""

from __future__ import annotations

import itertools
import uuid
from typing import TYPE_CHECKING, Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from k2b_workflows import settings
from k2b_workflows.kernel import audit, contradictions, flow_audit, witness
from k2b_workflows.lazy import LazyModule
from k2b_workflows.management.arguments import integer
from k2b_workflows.models import (
    JournalEntry,
    LedgerEntry,
    TaskAttempt,
    WorkflowRun,
    WorkflowSchedule,
)

MAX_BATCH = 100_000

#: Imported once a task attempt row is found: it imports django.tasks, which a project
#: without tasks may not have.
if TYPE_CHECKING:
    from k2b_workflows.tasks import runs as task_runs
else:
    task_runs = LazyModule("k2b_workflows.tasks.runs")


class Command(BaseCommand):
    help = (
        "Verify the keyed journal and ledger chains, the anchors and the run seals of every "
        "run, in batches, and with --witness the witness records of dispatches and ends; "
        "print each broken run (id, what, why) and exit non-zero if there is one."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--batch",
            type=integer(1, MAX_BATCH),
            default=500,
            help=f"runs read per batch (1 to {MAX_BATCH})",
        )
        parser.add_argument("--database", default=None, help="alias (default: DATABASE)")
        parser.add_argument(
            "--witness",
            action="append",
            default=[],
            metavar="FILE",
            help="a file of witness log lines to hold the database against (repeatable)",
        )

    def handle(
        self,
        *args: Any,
        batch: int,
        database: str | None,
        witness: list[str],
        **options: Any,
    ) -> None:
        using = database or settings.database()
        if using not in connections:
            raise CommandError(
                f"--database {using!r} is not an alias of DATABASES "
                f"(known: {', '.join(sorted(connections.settings)) or 'none'})"
            )
        lines = []
        for path in witness:
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    lines.extend(f.readlines())
            except OSError as exc:
                raise CommandError(f"--witness {path}: {exc.strerror or exc}") from None
        checked, broken = self._runs(using, batch)
        summary = f"verified {checked} runs: {broken} broken"
        schedules, tampered = self._schedules(using)
        if schedules:
            summary += f"; {schedules} schedules: {tampered} not written by the key holder"
            broken += tampered
        attempts = self._task_attempts(using)
        if attempts:
            broken += attempts
            summary += f"; {attempts} task attempt rows not written by the key holder"
        # Slots, limits and budgets no kernel path leaves behind (#35).
        flow = flow_audit.findings(using)
        for line in flow:
            self.stdout.write(f"FLOW {line}")
        if flow:
            broken += len(flow)
            summary += f"; {len(flow)} flow-control or budget findings"
        # Late results that contradict a reconcile or an operator (#47): the provider's
        # real answer against what the run was told. Not a broken chain: both entries
        # are genuine; said until an operator resolves the step, not counted as broken.
        contradicted = contradictions.findings(using)
        for line in contradicted:
            self.stdout.write(f"CONTRADICTED {line}")
        if contradicted:
            summary += f"; {len(contradicted)} effects contradicted by a late result"
        if witness:
            records, findings = _witnessed(lines, using)
            for finding in findings:
                self.stdout.write(f"WITNESS {finding}")
            broken += len(findings)
            summary += f"; {records} witness records: {len(findings)} not held"
        if broken:
            raise CommandError(summary)
        self.stdout.write(summary)

    def _schedules(self, using: str) -> tuple[int, int]:
        """Schedule rows whose seal does not match: a pass refuses (or refused) them."""
        checked = broken = 0
        for row in WorkflowSchedule.objects.using(using).order_by("schedule_id").iterator():
            checked += 1
            problem = row.seal_problem()
            if problem is not None:
                broken += 1
                self.stdout.write(
                    f"BROKEN schedule {row.schedule_id} ({row.display_name}): {problem}"
                )
        return checked, broken

    def _task_attempts(self, using: str) -> int:
        """Task attempt rows a reader refuses (forged, edited or copied): how many."""
        broken = 0
        rows = TaskAttempt.objects.using(using).order_by("run_id", "id").iterator()
        for run_id, group in itertools.groupby(rows, key=lambda row: row.run_id):
            for row, problem in task_runs.checked_attempts(list(group))[1]:
                broken += 1
                self.stdout.write(
                    f"BROKEN task attempt {run_id} #{row.attempt} (row {row.pk}): {problem}"
                )
        return broken

    def _runs(self, using: str, batch: int) -> tuple[int, int]:
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
            journals: dict[uuid.UUID, list[JournalEntry]] = {pk: [] for pk in ids}
            ledgers: dict[uuid.UUID, list[LedgerEntry]] = {pk: [] for pk in ids}
            for entry in (
                JournalEntry.objects.using(using).filter(run_id__in=ids).order_by("run_id", "seq")
            ):
                journals[entry.run_id].append(entry)
            for noted in LedgerEntry.objects.using(using).filter(run_id__in=ids).order_by("id"):
                ledgers[noted.run_id].append(noted)
            for run in page:
                problem = audit.check(run, journals[run.pk], ledgers[run.pk])
                if problem is not None:
                    # The batch was read in several statements: a live run may have
                    # appended between two of them. Only a problem seen in one
                    # snapshot counts.
                    problem = audit.stored_problem(run.pk, using)
                if problem is not None:
                    broken += 1
                    self.stdout.write(
                        f"BROKEN {run.pk} {run.display_name} ({run.status}): {problem}"
                    )
            checked += len(page)
            after = page[-1].pk
        return checked, broken


def _witnessed(lines: list[str], using: str) -> tuple[int, list[witness.Finding]]:
    return witness.check(lines, using)
