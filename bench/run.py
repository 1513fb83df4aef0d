"""Benchmarks: wake latency, steps/s and commits/step per effect class, and pgbench.

Usage: ``DATABASE_URL=postgres://... python bench/run.py [--runs N] [--steps M]``
(``make bench``). Creates ``<db>_bench`` and ``<db>_pgbench`` on the same server,
drops them afterwards, prints a report and writes it to ``bench/RESULTS.md``.

What is measured, and how:

- **Wake latency**: runs park on gates; for each, the bench commits "open the
  gate + wake" in one transaction and notes the time COMMIT returned; the
  woken action notes ``time.time()`` as its first statement. One idle worker
  process (``runworkflows``, listening) on the same machine, so the clocks agree.
- **Steps/s and commits/step**: N runs of M steps of one effect class, run by
  ``runworkflows --burst``; commits are the delta of ``xact_commit`` in
  ``pg_stat_database`` for the bench database over the worker's life, minus
  what an idle ``--burst`` worker costs (start-up and exit), read from another
  database so that reading does not count. Steps/s is total steps over the time
  from the first step's start to the last run's end.
- **pgbench**: TPC-B-like, ``-c 4 -j 2 -T 10``, scale 10, on the same server.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"
sys.path.insert(0, str(ROOT))

TARGETS = {"PURE": 1, "TRANSACTIONAL": 1, "IDEMPOTENT": 1, "EXTERNAL": 2}


def with_db(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def admin_execute(url: str, *statements: str) -> None:
    import psycopg

    with psycopg.connect(with_db(url, "postgres"), autocommit=True) as conn:
        for sql in statements:
            conn.execute(sql)


class Bench:
    def __init__(self, url: str, runs: int, steps: int, wakes: int, threads: int) -> None:
        self.url = url
        base = urlsplit(url).path.lstrip("/") or "k2b"
        self.db = f"{base}_bench"
        self.pgbench_db = f"{base}_pgbench"
        self.runs, self.steps, self.wakes, self.threads = runs, steps, wakes, threads
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "bench.settings",
            "K2B_BENCH_DB": self.db,
            "PYTHONUNBUFFERED": "1",
        }
        self.lines: list[str] = []

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    # -- setup -------------------------------------------------------------

    def setup(self) -> None:
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

    def teardown(self) -> None:
        from django.db import connection

        connection.close()
        admin_execute(
            self.url,
            f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)',
            f'DROP DATABASE IF EXISTS "{self.pgbench_db}" WITH (FORCE)',
        )

    def worker(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "runworkflows", "--app", "bench", *args],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def commits(self) -> int:
        """``xact_commit`` of the bench database, read from another database (not counted)."""
        import psycopg

        # Backends flush their counters when idle (at most once a second) or on exit.
        time.sleep(1.2)
        with psycopg.connect(with_db(self.url, "postgres"), autocommit=True) as conn:
            return conn.execute(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", [self.db]
            ).fetchone()[0]

    # -- wake latency ---------------------------------------------------------

    def wake_latency(self) -> dict[str, float]:
        import random

        from django.db import connection, transaction

        from k2b_workflows import start_workflow_run, wake_workflow_runs_waiting_on
        from k2b_workflows.models import WorkflowRun

        with transaction.atomic():
            for i in range(self.wakes):
                start_workflow_run("bench.wait", {"key": f"w{i}"})
        proc = self.worker("--concurrency", "2")
        try:
            deadline = time.monotonic() + 120
            while (
                WorkflowRun.objects.filter(workflow_name="bench.wait", status="waiting").count()
                < self.wakes
            ):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("runs did not all park")
                time.sleep(0.1)
            time.sleep(1.0)  # the worker is idle, listening
            latencies: list[float] = []
            commit_ms: list[float] = []
            for i in range(self.wakes):
                key = f"w{i}"
                with transaction.atomic():
                    with connection.cursor() as cursor:
                        cursor.execute("INSERT INTO bench_gate (key) VALUES (%s)", [key])
                    wake_workflow_runs_waiting_on(app_id="bench", kind="gate", key=key)
                    before = time.time()
                committed = time.time()
                commit_ms.append((committed - before) * 1000)
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
        finally:
            proc.terminate()
            proc.communicate(timeout=60)
        latencies.sort()
        return {
            "n": len(latencies),
            "median": statistics.median(latencies),
            "p99": latencies[max(0, int(len(latencies) * 0.99) - 1)],
            "max": latencies[-1],
            "min": latencies[0],
            "commit_median": statistics.median(commit_ms),
        }

    # -- throughput and commits --------------------------------------------------

    def burst(self) -> tuple[int, float]:
        """Run a ``--burst`` worker to the end; returns (commits, wall seconds)."""
        from django.db import connection

        connection.close()
        before = self.commits()
        t0 = time.monotonic()
        proc = self.worker("--burst", "--concurrency", str(self.threads))
        out, _ = proc.communicate(timeout=1800)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"worker failed:\n{out}")
        return self.commits() - before, wall

    def throughput(self, effect: str, idle_commits: float) -> dict[str, float]:
        from django.db import connection, transaction

        from k2b_workflows import start_workflow_run
        from k2b_workflows.models import WorkflowRun

        name = f"bench.steps.{effect.lower()}"
        with transaction.atomic():
            ids = [start_workflow_run(name, {"steps": self.steps}).pk for _ in range(self.runs)]
        delta, wall = self.burst()
        statuses = Counter(WorkflowRun.objects.filter(pk__in=ids).values_list("status", flat=True))
        done = statuses["succeeded"]
        if done != self.runs:
            raise RuntimeError(f"{effect}: only {done} of {self.runs} runs succeeded: {statuses}")
        with connection.cursor() as cursor:
            cursor.execute(
                """SELECT EXTRACT(EPOCH FROM max(r.finished_at) - min(j.started_at))
                     FROM k2b_run r JOIN k2b_journal j ON j.run_id = r.id
                    WHERE r.workflow_name = %s""",
                [name],
            )
            seconds = float(cursor.fetchone()[0])
        total = self.runs * self.steps
        net = delta - idle_commits
        return {
            "steps": total,
            "seconds": seconds,
            "steps_per_s": total / seconds,
            "commits": delta,
            "net_commits": net,
            "per_step": net / total,
            "per_run_extra": (net - TARGETS[effect] * total) / self.runs,
            "wall": wall,
        }

    # -- pgbench -----------------------------------------------------------------

    def pgbench(self) -> dict[str, float] | None:
        binary = shutil.which("pgbench") or next(
            iter(sorted(Path("/usr/lib/postgresql").glob("*/bin/pgbench"), reverse=True)), None
        )
        if not binary:
            self.say("pgbench: not found (skipped)")
            return None
        admin_execute(
            self.url,
            f'DROP DATABASE IF EXISTS "{self.pgbench_db}" WITH (FORCE)',
            f'CREATE DATABASE "{self.pgbench_db}"',
        )
        target = with_db(self.url, self.pgbench_db)
        subprocess.run(
            [str(binary), "-i", "-s", "10", "-q", target],
            check=True,
            capture_output=True,
            text=True,
        )
        result = subprocess.run(
            [str(binary), "-c", "4", "-j", "2", "-T", "10", target],
            check=True,
            capture_output=True,
            text=True,
        )
        tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", result.stdout)
        latency = re.search(r"latency average = ([\d.]+) ms", result.stdout)
        return {
            "tps": float(tps.group(1)) if tps else float("nan"),
            "latency_ms": float(latency.group(1)) if latency else float("nan"),
        }

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
        mem = ""
        try:
            kb = int(Path("/proc/meminfo").read_text().split()[1])
            mem = f", {kb / 1024 / 1024:.0f} GiB RAM"
        except (OSError, ValueError, IndexError):
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
            f"- Machine: {platform.system()} {platform.machine()}, {cpu}, "
            f"{os.cpu_count()} cores{mem}",
            f"- {version} on the same host (fsync={fsync}, synchronous_commit={sync})",
            f"- Python {platform.python_version()}, Django {django.get_version()}",
        ]

    def main(self) -> None:
        self.setup()
        try:
            self.say("# k2b_workflows benchmarks")
            self.say()
            for line in self.machine():
                self.say(line)
            self.say("- Other processes may share this machine: absolute numbers are noisy.")
            self.say()

            lat = self.wake_latency()
            self.say("## Wake latency (commit of a wake -> woken step starts)")
            self.say()
            self.say(f"{lat['n']} wakes, one idle worker process listening (2 threads).")
            self.say()
            self.say("| median | p99 | min | max | target |")
            self.say("|---|---|---|---|---|")
            self.say(
                f"| {lat['median']:.1f} ms | {lat['p99']:.1f} ms | {lat['min']:.1f} ms | "
                f"{lat['max']:.1f} ms | median < 20 ms, p99 < 100 ms |"
            )
            self.say()
            self.say(
                f"(The waker's COMMIT itself took {lat['commit_median']:.1f} ms median; "
                "it is not included.)"
            )
            self.say()

            idle, _ = self.burst()
            self.say(
                f"## Steps/s and commits/step ({self.runs} runs x {self.steps} steps, "
                f"one worker process, {self.threads} threads)"
            )
            self.say()
            self.say(
                f"An idle `--burst` worker (start-up, exit) costs {idle} commits; subtracted below."
            )
            self.say()
            self.say(
                "| effect | steps/s | commits/step | target | extra commits/run "
                "(beyond target x steps) |"
            )
            self.say("|---|---|---|---|---|")
            results = {}
            for effect in TARGETS:
                r = self.throughput(effect, idle)
                results[effect] = r
                self.say(
                    f"| {effect} | {r['steps_per_s']:.0f} | {r['per_step']:.2f} | "
                    f"{TARGETS[effect]} (+ <= 2/run) | {r['per_run_extra']:.1f} |"
                )
            self.say()

            pg = self.pgbench()
            if pg:
                self.say("## pgbench on the same server")
                self.say()
                self.say(
                    "TPC-B-like, scale 10, `-c 4 -j 2 -T 10`: "
                    f"**{pg['tps']:.0f} tps** (latency average {pg['latency_ms']:.1f} ms). "
                    "Each pgbench transaction is one commit of 5 statements."
                )
                self.say()
                self.say("| effect | kernel commits/s (steps/s x commits/step) | vs pgbench tps |")
                self.say("|---|---|---|")
                for effect, r in results.items():
                    rate = r["steps_per_s"] * r["per_step"]
                    self.say(f"| {effect} | {rate:.0f} | {rate / pg['tps']:.0%} |")
                self.say()
        finally:
            self.teardown()
        RESULTS.write_text("\n".join(self.lines) + "\n")
        print(f"written to {RESULTS.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="runs per effect class")
    parser.add_argument("--steps", type=int, default=10, help="steps per run")
    parser.add_argument("--wakes", type=int, default=300, help="wakes for the latency benchmark")
    parser.add_argument("--threads", type=int, default=4, help="worker threads")
    args = parser.parse_args()
    url = os.environ.get("DATABASE_URL")
    if not url:
        sys.exit("DATABASE_URL is not set (make bench sets it)")
    Bench(url, args.runs, args.steps, args.wakes, args.threads).main()


if __name__ == "__main__":
    main()
