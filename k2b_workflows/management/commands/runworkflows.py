"""``manage.py runworkflows``: run workers until stopped (or, with --burst, until idle)."""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from k2b_workflows.exceptions import DatabaseNotMigrated, DatabaseUnavailable
from k2b_workflows.worker import Worker, default_status_stream


class Command(BaseCommand):
    help = (
        "Claim and execute workflow runs. SIGTERM/SIGINT stop gracefully (steps in flight"
        " finish within SHUTDOWN_GRACE_MS, then their runs are handed back); a second one"
        " hands back and exits at once."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--app",
            action="append",
            dest="apps",
            metavar="APP",
            help="only runs of this app id (repeatable); default: all",
        )
        parser.add_argument(
            "--concurrency", type=int, default=4, help="threads executing runs (default 4)"
        )
        parser.add_argument("--burst", action="store_true", help="exit when nothing is left to run")
        parser.add_argument(
            "--no-listen", action="store_true", help="poll only; do not LISTEN for wake-ups"
        )
        parser.add_argument(
            "--wait-for-db",
            type=float,
            default=None,
            metavar="SECONDS",
            help="at start-up, wait at most this long for the database (default: forever)",
        )
        parser.add_argument(
            "--health-file",
            metavar="PATH",
            help="touch PATH after every healthy loop iteration (check: manage.py workerhealth)",
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            metavar="PORT",
            help="serve Prometheus metrics on PORT (0: any free port; needs prometheus_client)",
        )

    def handle(
        self,
        *args: Any,
        apps: list[str] | None,
        concurrency: int,
        burst: bool,
        no_listen: bool,
        wait_for_db: float | None,
        health_file: str | None = None,
        metrics_port: int | None = None,
        **options: Any,
    ) -> None:
        if concurrency < 1:
            raise CommandError("--concurrency must be at least 1")
        if wait_for_db is not None and wait_for_db < 0:
            raise CommandError("--wait-for-db must not be negative")
        if metrics_port is not None:
            from k2b_workflows import metrics

            if not metrics.AVAILABLE:
                raise CommandError(
                    "--metrics-port needs prometheus_client: pip install 'k2b-workflows[metrics]'"
                )
            if not 0 <= metrics_port <= 65535:
                raise CommandError("--metrics-port must be between 0 and 65535")
        worker = Worker(
            app_ids=apps,
            concurrency=concurrency,
            burst=burst,
            listen=not no_listen,
            status_stream=default_status_stream(),
            wait_for_db=wait_for_db,
            notice_stream=sys.stderr,
            health_file=health_file,
            metrics_port=metrics_port,
        )
        stops = 0

        def on_signal(signum: int, frame: Any) -> None:
            nonlocal stops
            stops += 1
            name = signal.Signals(signum).name
            if stops > 1:
                self.stderr.write(f"received {name} again: handing runs back, exiting now")
                worker.stop(force=True)
                return
            self.stderr.write(f"received {name}: stopping after current steps")
            worker.stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        # Jitter so a fleet restarted at once does not claim in lockstep.
        if not burst:
            time.sleep(random.uniform(0, 0.2))
        try:
            worker.run()
        except DatabaseNotMigrated as exc:
            raise CommandError(str(exc), returncode=2) from None
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc), returncode=2) from None
        except DatabaseUnavailable as exc:
            raise CommandError(str(exc), returncode=1) from None
        if not sys.stdout.isatty():
            self.stdout.write(f"worker stopped: {dict(worker.stats)}")
        if worker.abandoned:
            # Threads still inside a step (their runs handed back or fenced): the
            # interpreter would wait for them at exit. Nothing they write can commit.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
