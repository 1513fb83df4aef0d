"""``manage.py workflowstatus``: the fleet at a glance, and an exit status to alert on.

Exits 1 when some queued run has no live worker that can run it (its
workflow, version and app are on no worker whose heartbeat is fresh): such
runs wait forever, which no other signal shows until a customer does.
Exits 1 as well when a schedule is late: its next tick is more than
``SCHEDULE_MISSED_AFTER_MS`` overdue (no worker runs passes for it: all
``--no-schedules``, none has its workflow, or the fleet is down).
Exits 2 when the database cannot be read at all.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import DatabaseError

from k2b_workflows import fleet, naming, settings
from k2b_workflows.kernel import schedule_passes


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _name(entry: dict[str, Any]) -> str:
    """A report entry's workflow as people know it: a task's path for a task (#51)."""
    return naming.described_name(entry["workflow"], entry["task"])


class Command(BaseCommand):
    help = (
        "Print runs per status, the oldest queued run, open incidents and live workers. "
        "Exits 1 when queued runs have no live worker that can run them, or a schedule is late."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="print one JSON object")

    def handle(self, *args: Any, **options: Any) -> None:
        # Rows of workers that stopped beating become "lost" now, not at the
        # next beat of another worker (there may be none left).
        try:
            fleet.mark_lost()
            report = fleet.status()
            report["late_schedules"] = [
                {
                    "schedule_id": schedule_id,
                    "workflow": workflow,
                    "task": task_path,
                    "due": due.isoformat(),
                    "late_s": round(late, 1),
                }
                for schedule_id, workflow, due, late, task_path in schedule_passes.late(
                    settings.database()
                )
            ]
        except DatabaseError as exc:
            self.stderr.write(f"cannot read the workflow tables: {exc}".strip())
            sys.exit(2)
        if options["json"]:
            self.stdout.write(json.dumps(report, indent=2, sort_keys=True))
        else:
            self._print(report)
        if report["unserved"] or report["late_schedules"]:
            sys.exit(1)

    def _print(self, report: dict[str, Any]) -> None:
        out = self.stdout.write
        out("runs: " + ", ".join(f"{k} {v}" for k, v in report["runs"].items()))
        out(
            f"queued and due: {report['queued_due']}, "
            f"oldest waiting {_age(report['oldest_queued_age_s'])}"
        )
        out(f"open incidents: {report['open_incidents']}")
        if report["busiest_keys"]:
            out(f"queued behind concurrency keys: {report['queued_behind_keys']}; busiest keys:")
            for k in report["busiest_keys"]:
                name, key = k["workflow_name"], k["key"]
                out(f"  {name} {key!r}  active {k['active']}  queued {k['queued']}")
        workers = report["live_workers"]
        out(f"live workers: {len(workers)}")
        for w in workers:
            out(
                f"  {w['worker_id']}  busy {w['in_flight']}/{w['concurrency']}  "
                f"heartbeat {_age(w['heartbeat_age_s'])} ago  "
                f"{len(w['workflows'])} workflow(s)"
            )
        for late in report["late_schedules"]:
            self.stderr.write(
                f"LATE SCHEDULE {late['schedule_id']} ({_name(late)}): its tick of "
                f"{late['due']} has not fired for {_age(late['late_s'])}"
            )
        for u in report["unserved"]:
            self.stderr.write(
                f"NO LIVE WORKER for {_name(u)} v{u['version']} (app {u['app_id']}): "
                f"{u['queued']} queued run(s), oldest created {_age(u['oldest_age_s'])} ago"
            )
