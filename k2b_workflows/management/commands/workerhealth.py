"""``manage.py workerhealth PATH``: exit 0 when the worker's health file is fresh, else 1.

For a Kubernetes ``livenessProbe`` (``exec``) or a systemd timer next to a
worker started with ``runworkflows --health-file PATH``.
"""

from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from k2b_workflows.management.arguments import number
from k2b_workflows.worker.health import age_s


class Command(BaseCommand):
    help = "Exit 0 if the worker touched PATH within --max-age seconds, 1 otherwise."
    # A probe must answer even when the database is down: the worker may be
    # healthy and waiting for it, and the probe reads a file, not the database.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("path", help="the file given to runworkflows --health-file")
        parser.add_argument(
            "--max-age",
            type=number(0.0, 31_536_000.0),
            default=60.0,
            help="seconds since the last touch still counted healthy (default 60)",
        )

    def handle(self, *args: Any, path: str, max_age: float, **options: Any) -> None:
        if max_age <= 0:
            raise CommandError("--max-age must be positive")
        age = age_s(path)
        if age is None:
            self.stderr.write(f"unhealthy: {path} does not exist (worker not started or stopped)")
            sys.exit(1)
        if age > max_age:
            self.stderr.write(f"unhealthy: {path} last touched {age:.1f} s ago (> {max_age:g} s)")
            sys.exit(1)
        self.stdout.write(f"healthy: {path} touched {age:.1f} s ago")
