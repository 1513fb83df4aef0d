"""Benchmarks: steps/s and commits/step per effect class beside pgbench, wakes, fan-out, scale-out.

Usage: ``DATABASE_URL=postgres://... python bench/run.py [--quick]`` (``make bench``,
``make bench-quick``). Creates ``<db>_bench`` and ``<db>_pgbench`` on the server of
``DATABASE_URL``, drops them afterwards, and prints a report whose **last line is
one JSON object** with every number. The full run also writes ``bench/RESULTS.md``.

What is measured, and how (every workload in this one invocation, on one server,
so that ratios hold even when the machine is shared and absolute numbers are not):

- **Steps/s and commits/step** per effect class: N runs of a 3-step chain (PURE,
  TRANSACTIONAL, IDEMPOTENT, EXTERNAL, and a mix of the last three), drained by
  one ``runworkflows --burst`` process, start-up included in the commits; commits
  are the delta of ``xact_commit`` for the bench database (read from another
  database so that reading does not count), minus what an idle ``--burst``
  worker costs. Steps/s is total steps over the time from the first step's
  start to the last run's end. Worker RSS is sampled from ``/proc``. The
  classes are measured in ``--rounds`` passes (5; quick: 1), each after its
  own pgbench; every figure is the median of the rounds, and ratios are taken
  within a round first (a class takes seconds; a shared machine's load
  changes within minutes).
- **pgbench**: a one-row ``UPDATE`` + commit per transaction, with as many
  clients as the worker has threads: the server's commit rate for this
  concurrency, the ceiling of a durable step. ``ratio_to_pgbench`` is PURE
  steps/s over that rate (median of the rounds).
- **Wake latency**: runs park on gates; the bench commits "open the gate + wake"
  and notes when COMMIT returned; the woken action notes ``time.time()`` first.
  One idle worker process listening, on the same machine (same clock).
- **Result latency**: a caller thread in the bench process waits with
  ``wait_for_workflow_run`` on a parked run; the bench opens its gate; the
  latency is the caller's return (``time.time()``) minus the run's
  ``finished_at`` (``--results-only`` measures only this).
- **Fan-out**: one parent starts ``--fanout`` children (each one step charged
  to the root's budget); the lag is the parent's end minus the last child's end.
- **Processes**: the PURE workload drained by 1, 2, 4 worker processes at once,
  4 threads each (``--process-threads``).
- **Start-up**: seconds from the ``exec`` of ``manage.py runworkflows --burst``
  to its first claim (the first step's ``started_at`` of the one queued run:
  the same host's clock), and from the ``exec`` to the exit of a ``--burst``
  with nothing to do; medians of ``--startup-repeats``. The project's bytecode
  is compiled first (``compileall``), as an installed package's is: with
  ``PYTHONDONTWRITEBYTECODE`` an editable checkout compiles every module at
  every start.
- **Drain** (``--drain``, and in the full run): ``--drain-runs`` (1,500) 3-step
  PURE runs drained by one ``runworkflows --burst --processes N --concurrency
  2`` for N = 1 and 2, timed from ``exec`` to exit (start-up included), beside
  pgbench with 2 clients, in ``--rounds`` rounds (medians); ``ratio_to_pgbench``
  is steps/s over pgbench's tps within each round.
- **Memory** (full run only): one worker drains 100,000 PURE steps (3-step
  runs, enqueued at once and not analyzed: a backlog as it arrives) while its
  RSS is sampled; early in the run and at the end.
- **Claim latency** (full run only): one claim statement timed with 10k and
  with 1M finished runs in the table (inserted by one ``INSERT ... SELECT
  generate_series``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"
sys.path.insert(0, str(ROOT))

EFFECTS = ("PURE", "TRANSACTIONAL", "IDEMPOTENT", "EXTERNAL", "MIX")


def with_db(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def admin_execute(url: str, *statements: str) -> None:
    import psycopg

    with psycopg.connect(with_db(url, "postgres"), autocommit=True) as conn:
        for sql in statements:
            conn.execute(sql)


def settled_commits(url: str, db: str, timeout: float = 30.0) -> int:
    """``xact_commit`` of ``db``, read from another database (so that reading is not
    counted), once no backend is connected to it.

    A backend adds its commits to the shared counters when it exits (and, while
    connected, only when idle, at most once a second). With none connected and
    two reads 50 ms apart agreeing (the flush comes a moment after a backend
    leaves ``pg_stat_activity``), the count is complete.
    """
    import psycopg

    deadline = time.monotonic() + timeout
    previous = None
    with psycopg.connect(with_db(url, "postgres"), autocommit=True) as conn:
        while True:
            connected, committed = conn.execute(
                """SELECT (SELECT count(*) FROM pg_stat_activity WHERE datname = %s),
                          (SELECT xact_commit FROM pg_stat_database WHERE datname = %s)""",
                [db, db],
            ).fetchone()
            if connected == 0 and committed == previous:
                return committed
            if time.monotonic() > deadline:
                raise RuntimeError(f"{connected} connection(s) to {db} stayed open")
            previous = committed if connected == 0 else None
            time.sleep(0.05)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's reaped children: the bench's worker
    and pgbench processes, each added once it has exited and been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _proc_cpu_s(pid: int, *, reaped: bool = False) -> float:
    """CPU seconds of process ``pid`` from ``/proc`` (with ``reaped``: its waited-for
    children's too); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    if reaped:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


class ServerCpu:
    """CPU seconds of a PostgreSQL server on this host: the postmaster, every process it
    runs (backends, WAL writer, checkpointer, autovacuum), and those that exited (the
    postmaster's reaped children). A difference of two readings is what the server
    did in between, backends that came and went included, and it counts every
    database of the server: measure on a quiet one."""

    def __init__(self, url: str) -> None:
        import psycopg

        with psycopg.connect(with_db(url, "postgres"), autocommit=True) as conn:
            backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        self.postmaster: int | None = None
        try:
            stat = Path(f"/proc/{backend}/stat").read_text().rsplit(")", 1)[1].split()
            self.postmaster = int(stat[1])  # the backend's parent
        except OSError:
            pass  # the server runs elsewhere: its CPU is not ours to read

    def read(self) -> float | None:
        if self.postmaster is None:
            return None
        total = _proc_cpu_s(self.postmaster, reaped=True)
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == self.postmaster:
                total += (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def settled(self, url: str, db: str, timeout: float = 30.0) -> float | None:
        """A reading taken once no backend of ``db`` is connected and two readings
        50 ms apart agree (#52). A reading taken the moment a client exits can miss
        its backend: still running its exit path (CPU to come), or reaped between
        the postmaster's line and the scan of its children (in neither)."""
        if self.postmaster is None:
            return None
        settled_commits(url, db, timeout)
        deadline = time.monotonic() + timeout
        previous = self.read()
        while True:
            time.sleep(0.05)
            current = self.read()
            if current == previous or time.monotonic() > deadline:
                return current
            previous = current


@contextlib.contextmanager
def _traced(connection: Any) -> Any:
    """Count the round trips of Django's ``connection`` in the block (libpq's trace)."""
    from psycopg import pq

    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    counted: list[int] = []
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            yield counted
        finally:
            pgconn.untrace()
            trace.seek(0)
            messages = ("\n" + trace.read()).split("\nF\t")[1:]
            kinds = [m.split("\t")[1].split()[0] for m in messages]
            counted.append(kinds.count("Query") + kinds.count("Sync"))


def per_unit_us(seconds: float | None, units: int) -> float | None:
    return None if seconds is None or units <= 0 else round(seconds * 1e6 / units, 1)


class RssSampler(threading.Thread):
    """Samples a process's resident set size (MiB) until it exits."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[float] = []

    def run(self) -> None:
        path = Path(f"/proc/{self.pid}/status")
        time.sleep(1.0)  # past the interpreter's start: from here on it is the worker's
        while True:
            try:
                text = path.read_text()
            except OSError:
                return
            match = re.search(r"VmRSS:\s+(\d+) kB", text)
            if match:
                self.samples.append(int(match.group(1)) / 1024)
            time.sleep(0.2)


class Bench:
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.args = args
        self.waited: dict[str, float] = {}
        base = urlsplit(url).path.lstrip("/") or "k2b"
        self.db = f"{base}_bench"
        self.pgbench_db = f"{base}_pgbench"
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "bench.settings",
            "K2B_BENCH_DB": self.db,
            "PYTHONUNBUFFERED": "1",
        }
        self.lines: list[str] = []
        #: CPU of the last ``burst``: (worker seconds, server seconds or None).
        self.cpu: tuple[float, float | None] = (0.0, None)
        self.server_cpu: ServerCpu | None = None
        #: CPU (client and server) per pgbench transaction, µs, one per pgbench run.
        self.pgbench_cpu: list[float] = []

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    # -- setup -------------------------------------------------------------

    def setup(self) -> None:
        self.server_cpu = ServerCpu(self.url)
        admin_execute(
            self.url,
            f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)',
            f'CREATE DATABASE "{self.db}"',
        )
        os.environ.update({"DJANGO_SETTINGS_MODULE": "bench.settings", "K2B_BENCH_DB": self.db})
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connection

        call_command("migrate", verbosity=0)
        with connection.cursor() as cursor:
            cursor.execute("CREATE TABLE bench_gate (key text PRIMARY KEY)")
            cursor.execute("CREATE TABLE bench_sample (key text PRIMARY KEY, started float8)")
            cursor.execute("CREATE TABLE bench_row (id bigserial PRIMARY KEY, effect_key text)")
            if self.args.schedules:
                # Schedules of the bench's own workflows, none due during the bench: every
                # worker probes for due ticks (once a second) as it would in production.
                cursor.execute(
                    """INSERT INTO k2b_schedule
                           (schedule_id, workflow_name, cron, every, timezone, input, catch_up,
                            overlap, paused, source, enabled, disabled_reason, anchor,
                            next_tick, next_fire_at, created_at, updated_at)
                       SELECT 'bench-' || n, 'bench.steps.mix', '', interval '1 day', 'UTC',
                              '{}', 'latest', 'skip', false, 'code', true, '', k2b_now(),
                              k2b_now() + interval '1 day' + n * interval '1 second',
                              k2b_now() + interval '1 day' + n * interval '1 second',
                              k2b_now(), k2b_now()
                         FROM generate_series(1, %s) n""",
                    [self.args.schedules],
                )
                cursor.execute("ANALYZE k2b_schedule")

    def teardown(self) -> None:
        from django.db import connection

        connection.close()
        admin_execute(
            self.url,
            f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)',
            f'DROP DATABASE IF EXISTS "{self.pgbench_db}" WITH (FORCE)',
        )

    def worker(self, *args: str) -> subprocess.Popen:
        """A worker on the bench's app. A ``--burst`` one's output is read by
        ``communicate()``; a long-lived one's is dropped (the bench stops it and never
        reads it): into an unread pipe, its witness lines (one a run) filled the
        pipe's 64 KiB within two hundred wakes, and the worker stopped on its next
        write."""
        output = subprocess.PIPE if "--burst" in args else subprocess.DEVNULL
        return subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "runworkflows", "--app", "bench", *args],
            cwd=ROOT,
            env=self.env,
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def commits(self) -> int:
        """``xact_commit`` of the bench database (``settled_commits``)."""
        return settled_commits(self.url, self.db)

    def enqueue(self, name: str, count: int, input: dict[str, Any]) -> list[Any]:
        from django.db import transaction

        from k2b_workflows import start_workflow_run

        with transaction.atomic():
            return [start_workflow_run(name, input).pk for _ in range(count)]

    # -- wake latency ---------------------------------------------------------

    def wake_latency(self) -> dict[str, float]:
        import random

        from django.db import connection, transaction

        from k2b_workflows import wake_workflow_runs_waiting_on
        from k2b_workflows.models import WorkflowRun

        wakes = self.args.wakes
        from k2b_workflows import start_workflow_run

        with transaction.atomic():
            for i in range(wakes):
                start_workflow_run("bench.wait", {"key": f"w{i}"})
        proc = self.worker("--concurrency", str(self.args.threads))
        try:
            deadline = time.monotonic() + 120
            while (
                WorkflowRun.objects.filter(workflow_name="bench.wait", status="waiting").count()
                < wakes
            ):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("runs did not all park")
                time.sleep(0.1)
            self.wait_listening()
            latencies: list[float] = []
            for i in range(wakes):
                key = f"w{i}"
                with transaction.atomic():
                    with connection.cursor() as cursor:
                        cursor.execute("INSERT INTO bench_gate (key) VALUES (%s)", [key])
                    wake_workflow_runs_waiting_on(app_id="bench", kind="gate", key=key)
                committed = time.time()
                started = None
                give_up = time.monotonic() + 30
                while started is None:
                    with connection.cursor() as cursor:
                        cursor.execute("SELECT started FROM bench_sample WHERE key = %s", [key])
                        row = cursor.fetchone()
                    if row:
                        started = row[0]
                    elif time.monotonic() > give_up:
                        raise RuntimeError(f"wake {key} never started its step")
                    else:
                        time.sleep(0.002)
                latencies.append((started - committed) * 1000)
                time.sleep(random.uniform(0.02, 0.05))  # idle again before the next wake
            self.waited = self.result_latency(proc)
        finally:
            proc.terminate()
            proc.communicate(timeout=60)
        return {
            "n": len(latencies),
            "p50": statistics.median(latencies),
            "p99": percentile(latencies, 0.99),
            "max": max(latencies),
        }

    def result_latency(self, proc: subprocess.Popen | None = None) -> dict[str, float]:
        """From a run's end to ``wait_for_workflow_run`` returning, in another process.

        Runs park on gates; a caller thread waits on one run at a time, the bench
        opens its gate, the worker ends the run, and the latency is the caller's
        ``time.time()`` at return minus the run's ``finished_at`` (the database's
        time of the ending statement, on the same machine: a little before its
        commit, so this is an upper bound).
        """
        import random

        from django.db import connection, connections, transaction

        from k2b_workflows import start_workflow_run, wait_for_workflow_run
        from k2b_workflows import wake_workflow_runs_waiting_on as wake
        from k2b_workflows.models import WorkflowRun
        from k2b_workflows.results import listener

        n = self.args.wakes
        with transaction.atomic():
            runs = [start_workflow_run("bench.wait", {"key": f"r{i}"}) for i in range(n)]
        own = proc is None
        if proc is None:  # --results-only; otherwise the wake bench's worker, still running
            proc = self.worker("--concurrency", str(self.args.threads))
        latencies: list[float] = []
        try:
            deadline = time.monotonic() + 120
            while (
                WorkflowRun.objects.filter(pk__in=[r.pk for r in runs], status="waiting").count()
                < n
            ):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("runs did not all park")
                time.sleep(0.1)
            for i, run in enumerate(runs):
                returned: list[float] = []

                def waiter(run_id: Any = run.pk, returned: list[float] = returned) -> None:
                    wait_for_workflow_run(run_id, timeout=60)
                    returned.append(time.time())
                    connections.close_all()

                thread = threading.Thread(target=waiter)
                thread.start()
                listener.listening.wait(30)
                time.sleep(random.uniform(0.02, 0.05))  # the caller is waiting, idle
                with transaction.atomic():
                    with connection.cursor() as cursor:
                        cursor.execute("INSERT INTO bench_gate (key) VALUES (%s)", [f"r{i}"])
                    wake(app_id="bench", kind="gate", key=f"r{i}")
                thread.join(90)
                if not returned:
                    raise RuntimeError(f"the wait for run {run.pk} never returned")
                finished = WorkflowRun.objects.get(pk=run.pk).finished_at
                latencies.append((returned[0] - finished.timestamp()) * 1000)
        finally:
            if own:
                proc.terminate()
                proc.communicate(timeout=60)
            listener.stop()
        return {
            "n": len(latencies),
            "p50": statistics.median(latencies),
            "p99": percentile(latencies, 0.99),
            "max": max(latencies),
        }

    def wait_listening(self, timeout: float = 60.0) -> None:
        """Until a worker's listener waits for notifications on the bench database."""
        import psycopg

        deadline = time.monotonic() + timeout
        with psycopg.connect(with_db(self.url, "postgres"), autocommit=True) as conn:
            while not conn.execute(
                """SELECT 1 FROM pg_stat_activity
                    WHERE datname = %s AND state = 'idle' AND query ILIKE 'LISTEN%%'""",
                [self.db],
            ).fetchone():
                if time.monotonic() > deadline:
                    raise RuntimeError("the worker never listened")
                time.sleep(0.02)

    # -- throughput and commits --------------------------------------------------

    def burst(
        self, processes: int = 1, threads: int | None = None
    ) -> tuple[int, float, list[float]]:
        """Run ``--burst`` workers (``threads`` each, default ``--threads``) to the end;
        returns (commits, wall seconds, RSS samples)."""
        from django.db import connection

        connection.close()
        before = self.commits()
        server = self.server_cpu.read() if self.server_cpu else None
        worker = children_cpu_s()
        t0 = time.monotonic()
        procs = [
            self.worker("--burst", "--concurrency", str(threads or self.args.threads))
            for _ in range(processes)
        ]
        sampler = RssSampler(procs[0].pid)
        sampler.start()
        outputs = [proc.communicate(timeout=1800)[0] for proc in procs]
        wall = time.monotonic() - t0
        sampler.join(timeout=5)
        for proc, out in zip(procs, outputs, strict=True):
            if proc.returncode != 0:
                raise RuntimeError(f"worker failed:\n{out}")
        commits = self.commits() - before  # every backend gone: the server's CPU is all in
        after = self.server_cpu.read() if self.server_cpu else None
        self.cpu = (
            children_cpu_s() - worker,
            None if server is None or after is None else after - server,
        )
        return commits, wall, sampler.samples

    def span(self, name: str) -> float:
        """Seconds from the first step's start to the last run's end, for runs of ``name``."""
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(
                """SELECT EXTRACT(EPOCH FROM max(r.finished_at) - min(j.started_at))
                     FROM k2b_run r JOIN k2b_journal j ON j.run_id = r.id
                    WHERE r.workflow_name = %s""",
                [name],
            )
            return float(cursor.fetchone()[0])

    def check_done(self, label: str, ids: list[Any]) -> None:
        from k2b_workflows.models import WorkflowRun

        statuses = Counter(WorkflowRun.objects.filter(pk__in=ids).values_list("status", flat=True))
        if statuses["succeeded"] != len(ids):
            raise RuntimeError(f"{label}: not every run succeeded: {dict(statuses)}")

    def retire(self, name: str) -> None:
        """Rename the finished runs of ``name``: ``span`` then times only the next batch."""
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE k2b_run SET workflow_name = 'bench.done' WHERE workflow_name = %s", [name]
            )

    def throughput(
        self, effect: str, idle_commits: float, idle_cpu: tuple[float, float | None]
    ) -> dict[str, Any]:
        """One class: ``--runs`` runs drained by one ``--burst`` worker. Commits and CPU
        are net of what an idle ``--burst`` costs (``idle_commits``, ``idle_cpu``: its
        start-up and exit), so that they are the runs' own."""
        name = f"bench.steps.{effect.lower()}"
        self.retire(name)
        runs, steps = self.args.runs, self.args.steps
        ids = self.enqueue(name, runs, {"steps": steps})
        delta, _, rss = self.burst()
        worker_s, server_s = self.cpu
        self.check_done(effect, ids)
        seconds = self.span(name)
        total = runs * steps
        net = delta - idle_commits
        idle_worker_s, idle_server_s = idle_cpu
        return {
            "steps_per_s": round(total / seconds, 1),
            "workflows_per_s": round(runs / seconds, 1),
            "commits_per_step": round(net / total, 3),
            "worker_cpu_us_per_step": per_unit_us(worker_s - idle_worker_s, total),
            "server_cpu_us_per_step": per_unit_us(
                None if server_s is None or idle_server_s is None else server_s - idle_server_s,
                total,
            ),
            "rss_start_mb": round(rss[0], 1) if rss else None,
            "rss_end_mb": round(rss[-1], 1) if rss else None,
        }

    def processes(self, count: int) -> dict[str, float]:
        name = "bench.steps.pure"
        self.retire(name)
        runs = self.args.runs * count
        ids = self.enqueue(name, runs, {"steps": self.args.steps})
        self.burst(count, self.args.process_threads)
        self.check_done(f"{count} processes", ids)
        seconds = self.span(name)
        return {"steps_per_s": round(runs * self.args.steps / seconds, 1)}

    # -- start-up and drains with --processes ------------------------------------

    def compile_bytecode(self) -> None:
        """Compile the project's modules, as ``pip install`` does for a package."""
        import compileall

        for folder in ("k2b_workflows", "example_project", "bench"):
            compileall.compile_dir(str(ROOT / folder), quiet=1)

    def startup(self, repeats: int) -> dict[str, float]:
        """Median seconds from exec to the first claim, and to the exit of an empty burst."""
        from django.db import connection

        name = "bench.steps.pure"
        first: list[float] = []
        empty: list[float] = []
        for _ in range(repeats):
            self.retire(name)
            self.enqueue(name, 1, {"steps": 1})
            connection.close()
            exec_at = time.time()
            proc = self.worker("--burst", "--concurrency", str(self.args.threads))
            out, _ = proc.communicate(timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"worker failed:\n{out}")
            with connection.cursor() as cursor:
                cursor.execute(
                    """SELECT EXTRACT(EPOCH FROM min(j.started_at))
                         FROM k2b_journal j JOIN k2b_run r ON r.id = j.run_id
                        WHERE r.workflow_name = %s""",
                    [name],
                )
                first.append(float(cursor.fetchone()[0]) - exec_at)
            connection.close()
            exec_at = time.time()
            proc = self.worker("--burst", "--concurrency", str(self.args.threads))
            out, _ = proc.communicate(timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"worker failed:\n{out}")
            empty.append(time.time() - exec_at)
        return {
            "first_claim_s": round(statistics.median(first), 3),
            "first_claim_min_s": round(min(first), 3),
            "empty_burst_s": round(statistics.median(empty), 3),
            "empty_burst_min_s": round(min(empty), 3),
            "repeats": repeats,
        }

    def drain(self, processes: int, runs: int, threads: int = 2) -> float:
        """Steps/s of ``runs`` 3-step PURE runs drained by one ``--burst --processes``
        command, from its exec to its exit."""
        from django.db import connection

        name = "bench.steps.pure"
        self.retire(name)
        ids = self.enqueue(name, runs, {"steps": 3})
        connection.close()
        t0 = time.monotonic()
        proc = self.worker("--burst", "--processes", str(processes), "--concurrency", str(threads))
        out, _ = proc.communicate(timeout=1800)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"worker failed:\n{out}")
        self.check_done(f"drain with {processes} process(es)", ids)
        return round(runs * 3 / wall, 1)

    def drains(self) -> dict[str, Any]:
        """pgbench c=2, then 1 and 2 processes, ``--rounds`` times; medians and ratios."""
        rounds = []
        for _ in range(self.args.rounds):
            tps = self.pgbench(2, self.args.pgbench_seconds)
            rates = {n: self.drain(n, self.args.drain_runs) for n in (1, 2)}
            rounds.append((tps, rates))
            self.say(f"drain round: pgbench {tps} tps, steps/s {rates}")
        out: dict[str, Any] = {
            "runs": self.args.drain_runs,
            "concurrency": 2,
            "pgbench_tps": round(statistics.median(t for t, _ in rounds if t), 1)
            if any(t for t, _ in rounds)
            else None,
        }
        for n in (1, 2):
            each = [rates[n] for _, rates in rounds]
            ratios = [rates[n] / t for t, rates in rounds if t]
            out[f"processes_{n}"] = {
                "steps_per_s": statistics.median(each),
                "rounds": each,
                "ratio_to_pgbench": round(statistics.median(ratios), 3) if ratios else None,
            }
        return out

    # -- memory over a long run ----------------------------------------------------

    def memory(self, steps: int) -> dict[str, Any]:
        """One worker drains ``steps`` PURE steps: RSS early in the run and at its end.

        "start" is the sample a twentieth of the way in (past imports, connections
        and the first claims), "end" the last one before the process exits.
        """
        name = "bench.steps.pure"
        self.retire(name)
        runs = -(-steps // self.args.steps)
        ids: list[Any] = []
        for start in range(0, runs, 5000):
            ids += self.enqueue(name, min(5000, runs - start), {"steps": self.args.steps})
        _, _, rss = self.burst()
        self.check_done("memory run", ids)
        seconds = self.span(name)
        return {
            "steps": runs * self.args.steps,
            "steps_per_s": round(runs * self.args.steps / seconds, 1),
            "rss_start_mb": round(rss[len(rss) // 20], 1),
            "rss_end_mb": round(rss[-1], 1),
            "rss_max_mb": round(max(rss), 1),
        }

    # -- fan-out -----------------------------------------------------------------

    def fanout(self) -> dict[str, float]:
        from django.db import connection

        (parent,) = self.enqueue("bench.fanout", 1, {"children": self.args.fanout})
        proc = self.worker("--burst", "--concurrency", str(self.args.threads))
        out, _ = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"worker failed:\n{out}")
        self.check_done("fan-out parent", [parent])
        with connection.cursor() as cursor:
            cursor.execute(
                """SELECT EXTRACT(EPOCH FROM p.finished_at - max(c.finished_at)),
                          EXTRACT(EPOCH FROM max(c.finished_at) - min(c.created_at)), count(*)
                     FROM k2b_run p JOIN k2b_run c ON c.parent_id = p.id
                    WHERE p.id = %s GROUP BY p.finished_at""",
                [parent],
            )
            lag, children_s, count = cursor.fetchone()
        return {
            "children": count,
            "children_per_s": round(count / float(children_s), 1),
            "parent_lag_s": round(float(lag), 3),
        }

    def rounds(
        self, idle: int, idle_cpu: tuple[float, float | None] = (0.0, None)
    ) -> tuple[float | None, float | None, dict[str, dict[str, Any]]]:
        """pgbench, then each effect class, ``--rounds`` times; returns the median pgbench
        rate, the median ratio of PURE steps/s to it, and each class's medians.

        A class takes a few seconds, and on a shared machine the load changes
        within minutes: one pass can put PURE and EXTERNAL in different
        weather. Ratios (``vs_pure``, to pgbench) are taken within each round,
        then the median of the rounds is reported, with every round's steps/s
        beside it.
        """
        rounds: list[tuple[float | None, dict[str, dict[str, Any]]]] = []
        self.pgbench_cpu = []
        for _ in range(self.args.rounds):
            tps = self.pgbench(self.args.threads, self.args.pgbench_seconds)
            rounds.append(
                (tps, {effect: self.throughput(effect, idle, idle_cpu) for effect in EFFECTS})
            )
        pure = [measured["PURE"]["steps_per_s"] for _, measured in rounds]
        effects: dict[str, dict[str, Any]] = {}
        for effect in EFFECTS:
            each = [measured[effect] for _, measured in rounds]
            effects[effect] = (
                {
                    key: statistics.median(e[key] for e in each)
                    for key in ("steps_per_s", "workflows_per_s", "commits_per_step")
                }
                | {
                    key: (
                        statistics.median(e[key] for e in each)
                        if all(e[key] is not None for e in each)
                        else None
                    )
                    for key in ("worker_cpu_us_per_step", "server_cpu_us_per_step")
                }
                | {
                    "rss_start_mb": each[0]["rss_start_mb"],
                    "rss_end_mb": each[-1]["rss_end_mb"],
                    "rounds": [e["steps_per_s"] for e in each],
                    "vs_pure": round(
                        statistics.median(
                            e["steps_per_s"] / p for e, p in zip(each, pure, strict=True)
                        ),
                        3,
                    ),
                }
            )
        rates = [t for t, _ in rounds if t]
        ratios = [p / t for p, (t, _) in zip(pure, rounds, strict=True) if t]
        return (
            round(statistics.median(rates), 1) if rates else None,
            round(statistics.median(ratios), 3) if ratios else None,
            effects,
        )

    # -- round trips -----------------------------------------------------------------

    def round_trips(self, runs: int = 20) -> dict[str, float]:
        """Round trips per step of each class, after the claim: ``runs`` runs claimed one
        at a time and executed in this process, counted from libpq's trace of the
        connection (a simple-protocol Query or an extended-protocol Sync each; a
        pipeline is one). The claim with its preload is one more per claim, shared
        by the runs it takes. Deterministic: the same code counts the same."""
        from django.db import connection, transaction

        from k2b_workflows.kernel import claim
        from k2b_workflows.kernel.execute import Execution
        from k2b_workflows.kernel.load import preload

        counts: dict[str, float] = {}
        for effect in EFFECTS:
            name = f"bench.steps.{effect.lower()}"
            self.retire(name)
            self.enqueue(name, runs + 1, {"steps": self.args.steps})
            total = 0
            for index in range(runs + 1):
                with transaction.atomic():
                    ((run_id, generation),) = claim.claim_runs(
                        "default", worker_id="bench", workflows=[(name, 1)], app_ids=None, limit=1
                    )
                    loaded = preload("default", [run_id])[run_id]
                with _traced(connection) as counted:
                    outcome = Execution(run_id, generation, preloaded=loaded).execute()
                if outcome != "succeeded":
                    raise RuntimeError(f"round trips of {effect}: a run ended {outcome}")
                if index:  # the first prepares the statements on this connection
                    total += counted[0]
            counts[effect] = round(total / (runs * self.args.steps), 2)
        return counts

    # -- claim latency -----------------------------------------------------------

    def claim_latency(self, finished: int) -> float:
        """Median ms of one claim statement with ``finished`` finished runs in the table."""
        from django.db import connection, transaction

        from k2b_workflows.kernel import claim

        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM k2b_run")
            have = cursor.fetchone()[0]
            if finished > have:
                cursor.execute(
                    """INSERT INTO k2b_run (id, workflow_name, workflow_version, app_id, status,
                              input, error_code, error_message, generation,
                              consecutive_failures, run_after, claimed_by, wait_kind, wait_key,
                              wait_signal_seq, created_at, updated_at, finished_at,
                              journal_anchor, ledger_anchor, start_seal, end_seal, holds_slot,
                              priority, priority_credit_ms, deferred_by, wait_action)
                       SELECT gen_random_uuid(), 'bench.old', 1, 'bench', 'succeeded', '{}',
                              '', '', 1, 0, now(), '', '', '', 0, now(), now(), now(), '', '',
                              '', '', false, 0, 0, '', ''
                         FROM generate_series(1, %s)""",
                    [finished - have],
                )
            cursor.execute("VACUUM ANALYZE k2b_run")
        self.enqueue("bench.steps.pure", 200, {"steps": 1})
        timings = []
        for _ in range(200):
            with transaction.atomic():
                t0 = time.perf_counter()
                claimed = claim.claim_runs(
                    "default",
                    worker_id="bench",
                    workflows=[("bench.steps.pure", 1)],
                    app_ids=None,
                    limit=1,
                )
                timings.append((time.perf_counter() - t0) * 1000)
            if not claimed:
                raise RuntimeError("nothing to claim")
        return round(statistics.median(timings), 3)

    # -- pgbench -----------------------------------------------------------------

    def pgbench(self, clients: int, seconds: int) -> float | None:
        """Transactions/s of a one-row UPDATE + commit with ``clients`` clients; the CPU
        (client and server) per transaction goes to ``pgbench_cpu``."""
        return pgbench(
            self.url,
            self.pgbench_db,
            clients,
            seconds,
            say=self.say,
            server_cpu=self.server_cpu,
            cpu_per_tx_us=self.pgbench_cpu,
        )

    # -- report ------------------------------------------------------------------

    def machine(self) -> list[str]:
        from django.db import connection

        cpu = "unknown CPU"
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        with connection.cursor() as cursor:
            cursor.execute("SELECT version()")
            version = cursor.fetchone()[0].split(" on ")[0]
            cursor.execute("SHOW synchronous_commit")
            sync = cursor.fetchone()[0]
            cursor.execute("SHOW fsync")
            fsync = cursor.fetchone()[0]
        import django

        return [
            f"- Date: {dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
            f"- Machine: {platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores",
            f"- {version} on the same host (fsync={fsync}, synchronous_commit={sync})",
            f"- Python {platform.python_version()}, Django {django.get_version()}",
        ]

    def main(self) -> dict[str, Any]:
        args = self.args
        self.setup()
        result: dict[str, Any] = {
            "mode": "classes" if args.classes else "quick" if args.quick else "full"
        }
        try:
            self.say("# k2b_workflows benchmarks")
            self.say()
            for line in self.machine():
                self.say(line)
            self.say("- Other processes may share this machine: compare ratios, not absolutes.")
            self.say()

            self.compile_bytecode()
            result["load_average"] = [round(x, 2) for x in os.getloadavg()]
            if args.classes:
                return self.classes(result)
            result["startup"] = self.startup(args.startup_repeats)
            self.say(
                f"Start-up (median of {args.startup_repeats}): exec -> first claim "
                f"{result['startup']['first_claim_s']} s; exec -> exit of an empty --burst "
                f"{result['startup']['empty_burst_s']} s."
            )
            if args.drain:
                result["drain"] = self.drains()
                result["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
                return result
            if args.results_only:
                waited = self.result_latency()
                self.say(
                    f"Result latency ({waited['n']} waits, run's end -> wait_for_workflow_run "
                    f"returns): median {waited['p50']:.2f} ms, p99 {waited['p99']:.2f} ms."
                )
                result.update(result_p50_ms=round(waited["p50"], 2))
                result.update(result_p99_ms=round(waited["p99"], 2))
                return result
            if not args.quick:
                self.burst()  # warm the caches once
            idle, _, _ = self.burst()
            idle_cpu = self.cpu
            tps, ratio, effects = self.rounds(idle, idle_cpu)
            pure = effects["PURE"]
            pgbench_cpu = statistics.median(self.pgbench_cpu) if self.pgbench_cpu else None
            result.update(
                pgbench_tps=tps,
                pgbench_cpu_us_per_tx=None if pgbench_cpu is None else round(pgbench_cpu, 1),
                round_trips_per_step=self.round_trips(),
                steps_per_s=pure["steps_per_s"],
                workflows_per_s=pure["workflows_per_s"],
                commits_per_step=pure["commits_per_step"],
                ratio_to_pgbench=ratio,
                effects=effects,
            )
            wake = self.wake_latency()
            result.update(wake_p50_ms=round(wake["p50"], 2), wake_p99_ms=round(wake["p99"], 2))
            waited = self.waited
            result.update(
                result_p50_ms=round(waited["p50"], 2), result_p99_ms=round(waited["p99"], 2)
            )
            result["fanout"] = self.fanout()
            result["process_threads"] = args.process_threads
            result["processes"] = {
                str(n): self.processes(n)["steps_per_s"] for n in args.process_counts
            }
            if args.memory_steps:
                result["memory"] = self.memory(args.memory_steps)
            if not args.quick:
                result["drain"] = self.drains()
                small = self.claim_latency(10_000)
                large = self.claim_latency(1_000_000)
                result["claim_ms"] = {"10k": small, "1M": large, "ratio": round(large / small, 2)}

            self.report(result, idle)
        finally:
            self.teardown()
        return result

    def classes(self, result: dict[str, Any]) -> dict[str, Any]:
        """``--classes``: only the effect classes and the mix, beside pgbench, with commits,
        round trips and worker and server CPU per step."""
        self.burst()  # warm the caches once
        idle, _, _ = self.burst()
        idle_cpu = self.cpu
        tps, ratio, effects = self.rounds(idle, idle_cpu)
        result.update(
            pgbench_tps=tps,
            pgbench_cpu_us_per_tx=(
                round(statistics.median(self.pgbench_cpu), 1) if self.pgbench_cpu else None
            ),
            round_trips_per_step=self.round_trips(),
            ratio_to_pgbench=ratio,
            effects=effects,
        )
        self.report_classes(result, idle)
        return result

    def report_classes(self, r: dict[str, Any], idle: int) -> None:
        a = self.args
        self.say(
            f"## {a.runs} runs x {a.steps} steps per effect class, one worker process, "
            f"{a.threads} threads, {a.rounds} round(s)"
        )
        self.say()
        self.say(
            f"pgbench, one-row UPDATE + commit, {a.threads} clients, same server, before "
            f"each round: **{r['pgbench_tps']} tps** (median). PURE steps/s over it, median "
            f"of the rounds: **{r['ratio_to_pgbench']}**. An idle `--burst` worker costs "
            f"{idle} commits (subtracted). Medians of the rounds; each round's steps/s "
            "in the last column."
        )
        self.say()
        self.say(
            "| effect | steps/s | workflows/s | commits/step | round trips/step | "
            "worker CPU µs/step | server CPU µs/step | vs PURE | rounds, steps/s |"
        )
        self.say("|---|---|---|---|---|---|---|---|---|")
        trips = r.get("round_trips_per_step", {})
        for effect, e in r["effects"].items():
            self.say(
                f"| {effect} | {e['steps_per_s']:.0f} | {e['workflows_per_s']:.0f} | "
                f"{e['commits_per_step']:.2f} | {trips.get(effect, '-')} | "
                f"{_us(e['worker_cpu_us_per_step'])} | {_us(e['server_cpu_us_per_step'])} | "
                f"{e['vs_pure']:.2f} | {', '.join(f'{v:.0f}' for v in e['rounds'])} |"
            )
        self.say()
        pure = r["effects"]["PURE"]
        cpu = r.get("pgbench_cpu_us_per_tx")
        both = (
            None
            if cpu is None or pure["server_cpu_us_per_step"] is None
            else (pure["worker_cpu_us_per_step"] + pure["server_cpu_us_per_step"]) / cpu
        )
        self.say(
            f"pgbench's CPU per transaction (its client and the server), median of the rounds: "
            f"{_us(cpu)} µs; a PURE step's worker and server CPU is "
            f"{'-' if both is None else f'{both:.1f}'}x that. Worker and server CPU are net "
            "of an idle `--burst` worker's (start-up and exit); server CPU is every process "
            "of the PostgreSQL server on this host (none when it runs elsewhere); round "
            "trips are after the claim, counted in-process."
        )
        self.say()

    def report(self, r: dict[str, Any], idle: int) -> None:
        a = self.args
        self.say(
            f"## {a.runs} runs x {a.steps} steps per effect class, one worker process, "
            f"{a.threads} threads, {a.rounds} round(s)"
        )
        self.say()
        self.say(
            f"pgbench, one-row UPDATE + commit, {a.threads} clients, same server, before "
            f"each round: **{r['pgbench_tps']} tps** (median). PURE steps/s over it, median "
            f"of the rounds: **{r['ratio_to_pgbench']}**. An idle `--burst` worker costs "
            f"{idle} commits (subtracted). Medians of the rounds; each round's steps/s "
            "in the last column."
        )
        self.say()
        self.say(
            "| effect | steps/s | workflows/s | commits/step | round trips/step | "
            "worker CPU µs/step | server CPU µs/step | vs PURE | rounds, steps/s |"
        )
        self.say("|---|---|---|---|---|---|---|---|---|")
        trips = r.get("round_trips_per_step", {})
        for effect, e in r["effects"].items():
            self.say(
                f"| {effect} | {e['steps_per_s']:.0f} | {e['workflows_per_s']:.0f} | "
                f"{e['commits_per_step']:.2f} | {trips.get(effect, '-')} | "
                f"{_us(e['worker_cpu_us_per_step'])} | {_us(e['server_cpu_us_per_step'])} | "
                f"{e['vs_pure']:.2f} | {', '.join(f'{v:.0f}' for v in e['rounds'])} |"
            )
        self.say()
        self.say(
            f"pgbench's CPU per transaction (its client and the server), median of the rounds: "
            f"{_us(r.get('pgbench_cpu_us_per_tx'))} µs. Worker and server CPU are net of an "
            "idle `--burst` worker's (start-up and exit); server CPU is every process of "
            "the PostgreSQL server on this host (none when it runs elsewhere); round trips "
            "are after the claim, counted in-process."
        )
        pure = r["effects"]["PURE"]
        self.say()
        if pure["rss_start_mb"] is None:
            # The sampler starts a second in, past the interpreter's start.
            self.say("Worker RSS (PURE run): not sampled, the worker ended within a second.")
        else:
            self.say(
                f"Worker RSS (PURE run): {pure['rss_start_mb']} MiB -> {pure['rss_end_mb']} MiB."
            )
        self.say()
        self.say(
            f"Wake latency ({a.wakes} wakes, commit of the wake -> woken step starts): "
            f"median {r['wake_p50_ms']} ms, p99 {r['wake_p99_ms']} ms."
        )
        self.say()
        self.say(
            f"Result latency ({a.wakes} waits, run's end -> `wait_for_workflow_run` returns "
            f"in another process): median {r['result_p50_ms']} ms, p99 {r['result_p99_ms']} ms."
        )
        self.say()
        f = r["fanout"]
        self.say(
            f"Fan-out: {f['children']} children at {f['children_per_s']}/s; the parent ended "
            f"{f['parent_lag_s']} s after the last child."
        )
        self.say()
        self.say(f"Worker processes ({a.process_threads} threads each), PURE steps/s:")
        self.say()
        self.say("| processes | steps/s |")
        self.say("|---|---|")
        for n, v in r["processes"].items():
            self.say(f"| {n} | {v:.0f} |")
        if "memory" in r:
            m = r["memory"]
            self.say()
            self.say(
                f"Memory: one worker ran {m['steps']} PURE steps ({m['steps_per_s']:.0f} steps/s); "
                f"RSS {m['rss_start_mb']} MiB early in the run, {m['rss_end_mb']} MiB at its "
                f"end (at most {m['rss_max_mb']} MiB)."
            )
        if "drain" in r:
            d = r["drain"]
            self.say()
            self.say(
                f"Drains of {d['runs']} 3-step PURE runs by one `runworkflows --burst "
                f"--concurrency 2`, exec to exit (start-up included), beside pgbench with 2 "
                f"clients ({d['pgbench_tps']} tps): --processes 1 "
                f"{d['processes_1']['steps_per_s']:.0f} steps/s "
                f"({d['processes_1']['ratio_to_pgbench']} of pgbench), --processes 2 "
                f"{d['processes_2']['steps_per_s']:.0f} steps/s "
                f"({d['processes_2']['ratio_to_pgbench']})."
            )
        if "claim_ms" in r:
            c = r["claim_ms"]
            self.say()
            self.say(
                f"Claim latency (one claim statement, median): {c['10k']} ms with 10k "
                f"finished runs, {c['1M']} ms with 1M ({c['ratio']}x)."
            )
        self.say()


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument(
        "--classes",
        action="store_true",
        help="only the effect classes and the mix beside pgbench: steps/s, commits, round"
        " trips, worker and server CPU per step (with --rounds)",
    )
    parser.add_argument("--runs", type=int, help="runs per effect class (300)")
    parser.add_argument("--steps", type=int, default=3, help="steps per run (3)")
    parser.add_argument(
        "--rounds", type=int, help="passes over the effect classes, medians reported (5; quick: 1)"
    )
    parser.add_argument("--threads", type=int, default=2, help="threads per worker (2)")
    parser.add_argument("--wakes", type=int, help="wakes timed (200; quick: 10)")
    parser.add_argument("--fanout", type=int, help="children of the fan-out (1000; quick: 50)")
    parser.add_argument(
        "--processes", default=None, help="worker process counts, e.g. 1,2,4 (quick: 1,2)"
    )
    parser.add_argument(
        "--process-threads", type=int, default=4, help="threads per worker of --processes (4)"
    )
    parser.add_argument(
        "--memory-steps",
        type=int,
        help="PURE steps one worker runs while its RSS is sampled (100000; quick: none)",
    )
    parser.add_argument(
        "--schedules",
        type=int,
        default=0,
        help="schedules of the bench's workflows present (none due) while it runs (0)",
    )
    parser.add_argument(
        "--startup-repeats", type=int, default=5, help="start-ups timed, median reported (5)"
    )
    parser.add_argument(
        "--drain",
        action="store_true",
        help="only the start-up and the drains: --drain-runs 3-step PURE runs by --processes 1"
        " and 2 (--concurrency 2), start-up included, beside pgbench with 2 clients",
    )
    parser.add_argument("--drain-runs", type=int, default=1500, help="runs of each drain (1500)")
    parser.add_argument(
        "--results-only",
        action="store_true",
        help="only the result latency (wait_for_workflow_run), with --wakes waits",
    )
    args = parser.parse_args()
    quick = args.quick
    # Quick keeps the full run's classes (300 runs, about two seconds each): with
    # 30, a worker's start-up ramp was most of the span and the ratios read low.
    args.runs = args.runs or 300
    args.rounds = args.rounds or (1 if quick else 5)
    args.wakes = args.wakes or (10 if quick else 200)
    args.fanout = args.fanout or (50 if quick else 1000)
    if args.memory_steps is None:
        args.memory_steps = 0 if quick else 100_000
    args.process_counts = [
        int(n) for n in (args.processes or ("1,2" if quick else "1,2,4")).split(",")
    ]
    args.pgbench_seconds = 2 if quick else 5
    url = os.environ.get("DATABASE_URL")
    if not url:
        sys.exit("DATABASE_URL is not set (make bench sets it)")
    bench = Bench(url, args)
    result = bench.main()
    if not quick and not args.results_only and not args.drain and not args.classes:
        RESULTS.write_text("\n".join(bench.lines) + "\n")
        print(f"written to {RESULTS.relative_to(ROOT)}")
    print(json.dumps(result, sort_keys=True))


def pgbench(
    url: str,
    database: str,
    clients: int,
    seconds: int,
    say: Any = print,
    *,
    server_cpu: ServerCpu | None = None,
    cpu_per_tx_us: list[float] | None = None,
) -> float | None:
    """Transactions/s of a one-row UPDATE + commit with ``clients`` clients, on a fresh
    ``database`` of the server of ``url`` (left for the caller to drop).

    With ``server_cpu`` and ``cpu_per_tx_us``, the client and server CPU per
    transaction (µs) is appended to ``cpu_per_tx_us``: what a commit costs on
    this host, beside which the benchmark's own CPU figures are read.
    """
    binary = shutil.which("pgbench") or next(
        iter(sorted(Path("/usr/lib/postgresql").glob("*/bin/pgbench"), reverse=True)), None
    )
    if not binary:
        say("pgbench: not found (skipped)")
        return None
    admin_execute(
        url,
        f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)',
        f'CREATE DATABASE "{database}"',
    )
    import psycopg

    target = with_db(url, database)
    with psycopg.connect(target, autocommit=True) as conn:
        conn.execute("CREATE TABLE one_row (id int PRIMARY KEY, n bigint NOT NULL)")
        conn.execute("INSERT INTO one_row SELECT i, 0 FROM generate_series(1, 10000) i")
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as script:
        script.write("\\set id random(1, 10000)\nUPDATE one_row SET n = n + 1 WHERE id = :id;\n")
    server = server_cpu.read() if server_cpu else None
    client = children_cpu_s()
    try:
        result = subprocess.run(
            [
                *(str(binary), "-n", "-f", script.name),
                *("-c", str(clients), "-j", str(clients), "-T", str(seconds), target),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
    finally:
        os.unlink(script.name)
    after = server_cpu.settled(url, database) if server_cpu else None
    cpu = None
    if server is not None and after is not None:
        cpu = after - server + children_cpu_s() - client
    tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", result.stdout)
    done = re.search(r"number of transactions actually processed: (\d+)", result.stdout)
    if done and cpu is not None and cpu_per_tx_us is not None:
        cpu_per_tx_us.append(cpu / int(done.group(1)) * 1e6)
    return float(tps.group(1)) if tps else None


if __name__ == "__main__":
    main()
