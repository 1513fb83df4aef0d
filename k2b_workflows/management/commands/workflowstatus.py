"""``manage.py workflowstatus``: the fleet at a glance, and an exit status to alert on.

Exits 1 when some queued run has no live worker that can run it (its
workflow, version and app are on no worker whose heartbeat is fresh): such
runs wait forever, which no other signal shows until a customer does.
Exits 2 when the database cannot be read at all.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand
from django.db import DatabaseError

from k2b_workflows import fleet


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class Command(BaseCommand):
    help = (
        "Print runs per status, the oldest queued run, open incidents and live workers. "
        "Exits 1 when queued runs have no live worker that can run them."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--json", action="store_true", help="print one JSON object")

    def handle(self, *args: Any, **options: Any) -> None:
        # Rows of workers that stopped beating become "lost" now, not at the
        # next beat of another worker (there may be none left).
        try:
            fleet.mark_lost()
            report = fleet.status()
        except DatabaseError as exc:
            self.stderr.write(f"cannot read the workflow tables: {exc}".strip())
            sys.exit(2)
        if options["json"]:
            self.stdout.write(json.dumps(report, indent=2, sort_keys=True))
        else:
            self._print(report)
        if report["unserved"]:
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
        for u in report["unserved"]:
            self.stderr.write(
                f"NO LIVE WORKER for {u['workflow']} v{u['version']} (app {u['app_id']}): "
                f"{u['queued']} queued run(s), oldest created {_age(u['oldest_age_s'])} ago"
            )
