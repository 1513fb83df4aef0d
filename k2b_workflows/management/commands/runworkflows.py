"""``manage.py runworkflows``: run workers until stopped (or, with --burst, until idle)."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import sys
import time
from typing import Any

from django.core.checks import Tags
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError, connections

from k2b_workflows import settings
from k2b_workflows.exceptions import DatabaseNotMigrated, DatabaseUnavailable
from k2b_workflows.kernel import weather
from k2b_workflows.management import arguments
from k2b_workflows.worker import exits, logformat
from k2b_workflows.worker.loop import Worker, default_status_stream
from k2b_workflows.worker.options import WorkerOptions
from k2b_workflows.worker.stop_signals import stop_signals

#: Threads of one process. Past a few hundred, a process spends its time
#: switching threads and holding connections; scale out with more processes.
MAX_CONCURRENCY = 256
#: Worker processes of one supervisor: more than the cores of any machine it runs on.
MAX_PROCESSES = 256
#: Connections a worker holds besides its threads': the claiming loop, LISTEN,
#: and the lease keeper.
EXTRA_CONNECTIONS = 3

_CONNECTIONS_SQL = """
SELECT current_setting('max_connections')::int,
       current_setting('superuser_reserved_connections')::int,
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'),
       r.rolsuper, r.rolconnlimit,
       (SELECT count(*) FROM pg_stat_activity
         WHERE backend_type = 'client backend' AND usename = current_user)
  FROM pg_roles r WHERE r.rolname = current_user
"""


class Command(BaseCommand):
    # A worker serves no URL, template or admin page: their checks (which import
    # the URLconf and every model admin's views) are for the web processes. The
    # app's own checks (compatibility) and the models' still stop a broken start.
    requires_system_checks = [Tags.compatibility, Tags.models]
    help = (
        "Claim and execute workflow runs. SIGTERM/SIGINT stop gracefully: nothing new is"
        " claimed, every external call in flight is waited for until it returns (give the"
        " supervisor a stop timeout longer than the longest call), other steps finish"
        " within SHUTDOWN_GRACE_MS, then their runs are handed back. A second one hands"
        " back and exits at once, leaving a call in flight an unknown outcome."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--app",
            action="append",
            dest="apps",
            metavar="APP",
            type=arguments.text(100),
            help="only runs of this app id (repeatable); default: all",
        )
        parser.add_argument(
            "--queue",
            action="append",
            dest="queues",
            metavar="NAME",
            type=arguments.text(100),
            help="only django.tasks tasks enqueued on this queue (repeatable); default: every run",
        )
        parser.add_argument(
            "--concurrency",
            type=arguments.integer(1, MAX_CONCURRENCY),
            default=4,
            metavar="N",
            help=f"threads executing runs (default 4, at most {MAX_CONCURRENCY})",
        )
        parser.add_argument(
            "--processes",
            type=arguments.processes(MAX_PROCESSES),
            default=1,
            metavar="N",
            help="worker processes forked from this one, each with --concurrency threads "
            "(auto: one per core; default 1: this process is the worker)",
        )
        parser.add_argument("--burst", action="store_true", help="exit when nothing is left to run")
        parser.add_argument(
            "--no-listen", action="store_true", help="poll only; do not LISTEN for wake-ups"
        )
        parser.add_argument(
            "--no-schedules",
            action="store_true",
            help="run no schedule passes (other workers fire the ticks)",
        )
        parser.add_argument(
            "--wait-for-db",
            type=arguments.number(-1.0, 31_536_000.0),
            default=None,
            metavar="SECONDS",
            help="at start-up, wait at most this long for the database (default: forever)",
        )
        parser.add_argument(
            "--health-file",
            metavar="PATH",
            type=arguments.writable_file,
            help="touch PATH after every healthy loop iteration (check: manage.py workerhealth)",
        )
        parser.add_argument(
            "--log-format",
            choices=logformat.FORMATS,
            default=None,
            help="form of the lines printed to stderr when LOGGING configures no handler for "
            "k2b_workflows: text (default) or json, one object per line",
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            metavar="PORT",
            help="serve Prometheus metrics on PORT (0: any free port; needs prometheus_client)",
        )

    def run_from_argv(self, argv: list[str]) -> None:
        """As any command's, then end the process without the interpreter's teardown.

        Django's own ``run_from_argv`` turns a ``CommandError`` into a message and
        ``sys.exit``; that status, or 0, is the process's. The threads are joined
        and the ``atexit`` handlers run as at any exit (``exits.exit_now``); only
        the modules' teardown, a quarter of a second that serves nobody, is
        skipped. ``call_command`` does not come here: a test's process goes on.
        """
        try:
            super().run_from_argv(argv)
        except SystemExit as exc:
            exits.exit_now(exc.code)
        exits.exit_now(0)

    def handle(
        self,
        *args: Any,
        apps: list[str] | None,
        concurrency: int,
        burst: bool,
        no_listen: bool,
        wait_for_db: float | None,
        no_schedules: bool = False,
        health_file: str | None = None,
        metrics_port: int | None = None,
        log_format: str | None = None,
        processes: int = 1,
        queues: list[str] | None = None,
        **options: Any,
    ) -> None:
        if wait_for_db is not None and wait_for_db < 0:
            raise CommandError("--wait-for-db must not be negative")
        if log_format is not None and logformat.configured():
            self.stderr.write(
                f"--log-format {log_format} ignored: LOGGING configures the k2b_workflows logger"
            )
        worker_options = WorkerOptions(
            app_ids=apps,
            concurrency=concurrency,
            burst=burst,
            listen=not no_listen,
            status_stream=default_status_stream(),
            wait_for_db=wait_for_db,
            notice_stream=sys.stderr,
            health_file=health_file,
            metrics_port=metrics_port,
            schedules=not no_schedules,
            queues=queues,
        )
        log_handler = logformat.attach(log_format or "text")
        try:
            if processes > 1:
                self._supervise(processes, worker_options)
            else:
                self._run(worker_options)
        finally:
            logformat.detach(log_handler)

    def _run(self, options: WorkerOptions) -> None:
        self._check_connections(options.concurrency)
        self._check_metrics_port(options.metrics_port)
        worker = Worker(options)
        try:
            self._work(worker, options.burst)
        except (DatabaseNotMigrated, ImproperlyConfigured) as exc:
            raise CommandError(str(exc), returncode=2) from None
        except DatabaseUnavailable as exc:
            raise CommandError(str(exc), returncode=1) from None
        self._stopped(worker)

    def _supervise(self, processes: int, options: WorkerOptions) -> None:
        """Fork ``processes`` workers from this process (Django imported once) and keep them."""
        from k2b_workflows.worker.supervisor import EXIT_CONFIG, EXIT_UNAVAILABLE, Supervisor

        self._check_connections(options.concurrency, processes)
        self._check_metrics_port(options.metrics_port)

        def run_child(index: int, child_health: str | None) -> int:
            # Each child its own health file; the group's metrics port is the supervisor's;
            # no status line (N live status lines rewriting one terminal line would garble it).
            worker = Worker(
                dataclasses.replace(
                    options, health_file=child_health, metrics_port=None, status_stream=None
                )
            )
            try:
                self._work(worker, options.burst)
            except (DatabaseNotMigrated, ImproperlyConfigured) as exc:
                self.stderr.write(str(exc))
                return EXIT_CONFIG
            except DatabaseUnavailable as exc:
                self.stderr.write(str(exc))
                return EXIT_UNAVAILABLE
            self._stopped(worker)
            return 0

        supervisor = Supervisor(
            processes=processes,
            run_child=run_child,
            burst=options.burst,
            health_file=options.health_file,
            metrics_port=options.metrics_port,
            using=settings.database(),
        )
        code = supervisor.run()
        if code == 2:
            raise CommandError("a worker process could not start (see above)", returncode=2)
        if code:
            raise CommandError("a worker process found no database (see above)", returncode=code)

    def _check_metrics_port(self, metrics_port: int | None) -> None:
        if metrics_port is None:
            return
        from k2b_workflows import metrics

        if not metrics.AVAILABLE:
            raise CommandError(
                "--metrics-port needs prometheus_client: pip install 'k2b-workflows[metrics]'"
            )
        if not 0 <= metrics_port <= 65535:
            raise CommandError("--metrics-port must be between 0 and 65535")

    def _work(self, worker: Worker, burst: bool) -> None:
        """Run ``worker`` until it stops, SIGTERM/SIGINT acted on from a thread of their own.

        Raises what the worker's start-up raises for a configuration error
        (``DatabaseNotMigrated``, ``ImproperlyConfigured``) or a database that
        never came (``DatabaseUnavailable``).
        """
        stops = 0

        def on_signal(signum: int) -> None:
            # Called by the watcher thread (see stop_signals), never inside a handler.
            nonlocal stops
            stops += 1
            name = signal.Signals(signum).name
            if stops > 1:
                self.stderr.write(
                    f"received {name} again: handing runs back, exiting now"
                    " (an external call in flight is left an unknown outcome)"
                )
                worker.stop(force=True)
                return
            self.stderr.write(
                f"received {name}: stopping after current steps"
                " (external calls in flight are waited for; a second signal cuts them)"
            )
            worker.stop()

        with stop_signals(on_signal):
            # Jitter so a fleet restarted at once does not claim in lockstep.
            if not burst:
                time.sleep(random.uniform(0, 0.2))
            worker.run()

    def _stopped(self, worker: Worker) -> None:
        if not sys.stdout.isatty():
            self.stdout.write(f"worker stopped: {dict(worker.stats)}")
        if worker.abandoned:
            # Threads still inside a step (their runs handed back or fenced): the
            # interpreter would wait for them at exit. Nothing they write can commit.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    def _check_connections(self, concurrency: int, processes: int = 1) -> None:
        """Refuse a ``--concurrency`` the server can never serve; warn when it cannot now.

        A worker claims runs for threads that then fail to connect; every lease
        that expires meanwhile counts against the run. Better to say so at start.
        """
        try:
            with connections[settings.database()].cursor() as cursor:
                cursor.execute(_CONNECTIONS_SQL)
                max_conn, reserved, in_use, superuser, role_limit, role_in_use = cursor.fetchone()
        except DatabaseError as exc:
            if not weather.is_connection_error(exc):
                raise
            # Unreachable for now: the worker's start-up waits for it (--wait-for-db).
            weather.close_quietly(settings.database())
            return
        needed = (concurrency + EXTRA_CONNECTIONS) * processes
        asked = f"--concurrency {concurrency}"
        if processes > 1:
            asked = f"--processes {processes} {asked}"
        allowed = max_conn if superuser else max_conn - reserved
        if needed > allowed:
            raise CommandError(
                f"{asked} needs {needed} connections; the server allows "
                f"{allowed} (max_connections {max_conn}"
                + ("" if superuser else f" minus {reserved} reserved")
                + ")"
            )
        if role_limit >= 0 and needed > role_limit:
            raise CommandError(
                f"{asked} needs {needed} connections; the role's CONNECTION LIMIT is {role_limit}"
            )
        # This connection is one of those in use, and one the worker keeps.
        free = allowed - in_use + 1
        if role_limit >= 0:
            free = min(free, role_limit - role_in_use + 1)
        if needed > free:
            self.stderr.write(
                f"warning: {asked} needs {needed} connections and only "
                f"{free} are free now; threads will wait for connections"
            )
