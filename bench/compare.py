"""The same 3-step workload on k2b_workflows, DBOS and Procrastinate: one table, one invocation.

Usage: ``DATABASE_URL=postgres://... python bench/compare.py [--runs N] [--threads T]``
(the peers come with the optional ``bench`` extra: ``pip install -e '.[bench]'``).

Each engine gets a fresh database of its own on the server of ``DATABASE_URL``
and runs in its own process (DBOS is a per-process singleton). The workload:
``--runs`` workflows of 3 steps that each add one to a number, one worker
process with ``--threads`` threads (or that concurrency). What is timed: from
the first enqueue to the last completion, enqueues included (one transaction
each, as an application would start them). Commits are counted by PostgreSQL
(``xact_commit`` of the engine's database, read from another one) around a
process that starts the engine, runs the workload and stops the engine, once
none of its connections is left (a backend adds its count when it exits, or
when idle up to seconds later: a count read while the engine is connected
misses some); an idle start and stop of the same engine, measured the same
way, is subtracted, as is what the benchmark itself reads from that database.
Only public APIs are used:

- k2b_workflows: ``start_workflow_run`` per run, executed by one ``runworkflows``
  process started (and listening) before the clock starts;
- DBOS: ``@DBOS.workflow`` calling three ``@DBOS.step`` functions, enqueued on a
  queue (``DBOS.register_queue``) with ``worker_concurrency`` = threads, polled
  every 50 ms (the default, 1 s, would make the poll the limit), results
  awaited with handles;
- Procrastinate: no durable steps, so a workflow is a chain of three jobs
  (each step defers the next), drained by ``run_worker_async(wait=False)``.

An engine that cannot be installed or run here gets a row saying why.

``--tasks`` compares the django.tasks path instead (#37): ``--runs`` (default
3,000, the size of the issue's measurement) no-op tasks of one task module
(``bench/tasks_app``), enqueued each in a transaction of its own, then drained
by the engine's workers started on the full queue: k2b_workflows' backend
(pure tasks, one ``runworkflows --burst`` process with ``--threads`` threads,
default 8, and again as two processes, ``--processes 2``, with half the threads
each), django-tasks-db's (two ``db_worker --batch`` processes, as its
users drain a queue) and Procrastinate jobs (one worker, ``--threads``
concurrency). Every engine is timed the same way: tasks/s from the first
task's start to the last task's end as the engine itself records them, so
neither the enqueues nor a worker's start-up count for anyone; the enqueues
are reported apart (enqueues/s, commits per enqueue, and the CPU per enqueue of
the enqueuing process and of its server backend, #52), the drain's wall time
beside. pgbench with 2 clients runs beside them, and ``enqueue_many`` of
``--many`` calls against as many ``enqueue()`` calls.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import admin_execute, pgbench, settled_commits, with_db  # noqa: E402

# -- engines, each run in a process of its own ---------------------------------------


def engine_k2b(url: str, db: str, runs: int, threads: int) -> dict[str, Any]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "K2B_BENCH_DB": db,
        "PYTHONUNBUFFERED": "1",
    }
    os.environ.update({"DJANGO_SETTINGS_MODULE": "bench.settings", "K2B_BENCH_DB": db})
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from k2b_workflows import start_workflow_run

    call_command("migrate", verbosity=0)
    # Started and listening before the clock starts, as the peers' workers are.
    worker = subprocess.Popen(
        [
            *(sys.executable, str(ROOT / "manage.py"), "runworkflows"),
            *("--app", "bench", "--concurrency", str(threads)),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    polls = 0  # our own reads of the database, each a transaction: not the engine's
    try:
        with connection.cursor() as cursor:
            deadline = time.monotonic() + 120
            while True:
                polls += 1
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND query LIKE 'LISTEN%%'"
                )
                if cursor.fetchone()[0]:
                    break
                if time.monotonic() > deadline or worker.poll() is not None:
                    raise RuntimeError("the worker did not start listening")
                time.sleep(0.1)
        connection.close()
        t0 = time.time()
        for _ in range(runs):
            start_workflow_run("bench.steps.pure", {"steps": 3})
        with connection.cursor() as cursor:
            while True:
                polls += 1
                cursor.execute(
                    "SELECT count(*), EXTRACT(EPOCH FROM max(finished_at)) FROM k2b_run"
                    " WHERE status = 'succeeded'"
                )
                done, last = cursor.fetchone()
                if done == runs:
                    break
                time.sleep(0.2)
        connection.close()
        seconds = float(last) - t0 if runs else 0.0
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    return {"seconds": seconds, "own": polls}


def engine_dbos(url: str, db: str, runs: int, threads: int) -> dict[str, Any]:
    from dbos import DBOS, DBOSConfig

    config: DBOSConfig = {"name": "k2b-compare", "system_database_url": with_db(url, db)}
    DBOS(config=config)

    @DBOS.step()
    def add_one(n: int) -> int:
        return n + 1

    @DBOS.workflow()
    def three_steps(n: int) -> int:
        for _ in range(3):
            n = add_one(n)
        return n

    DBOS.launch()
    # The default queue poll is once a second: at that rate a queue of 2 runs 2
    # workflows/s. Polled every 50 ms it is limited by its work, not its poll.
    queue = DBOS.register_queue("compare", worker_concurrency=threads, polling_interval_sec=0.05)
    try:
        t0 = time.monotonic()
        handles = [queue.enqueue(three_steps, 0) for _ in range(runs)]
        results = [h.get_result() for h in handles]
        seconds = time.monotonic() - t0
    finally:
        DBOS.destroy()
    if results != [3] * runs:
        raise RuntimeError("DBOS: wrong results")
    return {"seconds": seconds, "own": 0}


def engine_procrastinate(url: str, db: str, runs: int, threads: int) -> dict[str, Any]:
    return _procrastinate(url, db, runs, threads, steps=3)


async def _procrastinate_schema(app: Any) -> None:
    """Install Procrastinate's schema unless present: the first (idle) process of an
    engine installs it, and every process pays the same read."""
    present = await app.connector.execute_query_one_async(
        "SELECT to_regclass('procrastinate_jobs') IS NOT NULL AS present"
    )
    if not present["present"]:
        await app.schema_manager.apply_schema_async()


def _procrastinate(url: str, db: str, runs: int, threads: int, steps: int) -> dict[str, Any]:
    import asyncio

    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=with_db(url, db)))
    finished: list[int] = []

    @app.task(name="step", queue="compare")
    async def step(n: int, left: int) -> None:
        if left > 1:
            await step.defer_async(n=n + 1, left=left - 1)
        else:
            finished.append(n + 1)

    async def main() -> dict[str, Any]:
        async with app.open_async():
            await _procrastinate_schema(app)
            t0 = time.monotonic()
            for _ in range(runs):
                await step.defer_async(n=0, left=steps)
            await app.run_worker_async(
                queues=["compare"], concurrency=threads, wait=False, install_signal_handlers=False
            )
            seconds = time.monotonic() - t0
        if len(finished) != runs:
            raise RuntimeError(f"Procrastinate: {len(finished)} of {runs} chains finished")
        return {"seconds": seconds, "own": 0}

    return asyncio.run(main())


ENGINES = {"k2b_workflows": engine_k2b, "DBOS": engine_dbos, "Procrastinate": engine_procrastinate}
PACKAGES = {
    "k2b_workflows": "k2b_workflows",
    "DBOS": "dbos",
    "Procrastinate": "procrastinate",
    "k2b_workflows tasks": "k2b_workflows",
    "k2b_workflows tasks (2 processes)": "k2b_workflows",
    "django-tasks-db": "django-tasks-db",
    "Procrastinate jobs": "procrastinate",
}


# -- the django.tasks path (--tasks) ------------------------------------------------------


def _tasks_django(db: str, kind: str) -> dict[str, str]:
    """Set up Django in this process on ``db`` with the ``kind`` of TASKS; the environment
    for its worker processes."""
    env = {
        "DJANGO_SETTINGS_MODULE": "bench.tasks_app.settings",
        "K2B_BENCH_DB": db,
        "K2B_BENCH_TASKS": kind,
        "PYTHONUNBUFFERED": "1",
    }
    os.environ.update(env)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return {**os.environ, **env}


def _enqueue_noops(runs: int) -> dict[str, Any]:
    """``runs`` calls of ``noop.enqueue()``, each in a transaction of its own, on the
    backend of this process's ``TASKS``; nothing runs them yet."""
    from django.db import connection

    from bench.run import _proc_cpu_s
    from bench.tasks_app.tasks import noop

    backend = None
    if runs:
        # The server's CPU of these enqueues: their backend's, from /proc (a server
        # on this host), read on its connection before the first and after the last.
        noop.enqueue(-1)
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            backend = cursor.fetchone()[0]
        runs -= 1
    server0, client0 = _proc_cpu_s(backend) if backend else 0.0, time.process_time()
    t0 = time.monotonic()
    for n in range(runs):
        noop.enqueue(n)
    seconds = time.monotonic() - t0
    client, server = time.process_time() - client0, _proc_cpu_s(backend) if backend else 0.0
    connection.close()
    return {
        "seconds": seconds,
        "own": 1 if backend else 0,
        "timed": runs,
        "client_us": round(client * 1e6 / runs, 1) if runs else None,
        "server_us": round((server - server0) * 1e6 / runs, 1) if runs else None,
    }


def _span(query: str, runs: int) -> dict[str, Any]:
    """``query``'s (finished count, seconds from the first start to the last end)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(query)
        done, span = cursor.fetchone()
    connection.close()
    if done != runs:
        raise RuntimeError(f"{done} of {runs} tasks succeeded")
    return {"span": float(span or 0.0)}


def k2b_tasks_enqueue(url: str, db: str, runs: int, threads: int) -> dict[str, Any]:
    _tasks_django(db, "k2b")
    return _enqueue_noops(runs)


def k2b_tasks_drain(
    url: str, db: str, runs: int, threads: int, processes: int = 1
) -> dict[str, Any]:
    """One ``runworkflows --burst`` drains the queue: ``threads`` threads in all, in
    ``processes`` worker processes (``--processes``; one: no supervisor)."""
    env = _tasks_django(db, "k2b")
    fork = ("--processes", str(processes)) if processes > 1 else ()
    t0 = time.monotonic()
    worker = subprocess.run(
        [
            *(sys.executable, str(ROOT / "manage.py"), "runworkflows", "--burst"),
            *("--app", "tasks", "--concurrency", str(max(1, threads // processes)), *fork),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=1800,
    )
    if worker.returncode:
        raise RuntimeError(f"runworkflows exited {worker.returncode}: {worker.stderr[-300:]}")
    # A pure task's journal entry records when its call started; the run's end
    # when it finished.
    row = _span(
        "SELECT count(*), EXTRACT(EPOCH FROM max(r.finished_at) - min(j.started_at))"
        " FROM k2b_run r JOIN k2b_journal j ON j.run_id = r.id AND j.seq = 0"
        " WHERE r.status = 'succeeded' AND r.workflow_name = 'k2b.task.pure'",
        runs,
    )
    return {**row, "seconds": time.monotonic() - t0, "own": 1}


def db_tasks_enqueue(url: str, db: str, runs: int, threads: int) -> dict[str, Any]:
    _tasks_django(db, "db")
    return _enqueue_noops(runs)


def db_tasks_drain(url: str, db: str, runs: int, threads: int) -> dict[str, Any]:
    """django-tasks-db: two ``db_worker --batch`` processes drain the queue, as its
    users run it (``threads`` does not apply: each worker runs one task at a time)."""
    env = _tasks_django(db, "db")
    t0 = time.monotonic()
    workers = [
        subprocess.Popen(
            [
                *(sys.executable, str(ROOT / "manage.py"), "db_worker"),
                *("--batch", "--no-startup-delay", "--interval", "0.05"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for worker in workers:
        _, err = worker.communicate(timeout=1800)
        if worker.returncode:
            raise RuntimeError(f"db_worker exited {worker.returncode}: {err.strip()[-300:]}")
    seconds = time.monotonic() - t0
    row = _span(
        "SELECT count(*), EXTRACT(EPOCH FROM max(finished_at) - min(started_at))"
        " FROM django_tasks_database_dbtaskresult WHERE status = 'SUCCESSFUL'",
        runs,
    )
    return {**row, "seconds": seconds, "own": 1}


def procrastinate_tasks_enqueue(url: str, db: str, runs: int, threads: int) -> dict[str, Any]:
    return _procrastinate_jobs(url, db, runs, threads, drain=False)


def procrastinate_tasks_drain(url: str, db: str, runs: int, threads: int) -> dict[str, Any]:
    return _procrastinate_jobs(url, db, runs, threads, drain=True)


def _procrastinate_jobs(
    url: str, db: str, runs: int, threads: int, *, drain: bool
) -> dict[str, Any]:
    """Procrastinate: defer ``runs`` no-op jobs, or drain them with one worker of
    ``threads`` concurrency (``run_worker_async(wait=False)``)."""
    import asyncio

    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=with_db(url, db)))

    @app.task(name="noop", queue="compare")
    async def noop(n: int) -> int:
        return n

    async def main() -> dict[str, Any]:
        async with app.open_async():
            await _procrastinate_schema(app)
            t0 = time.monotonic()
            if not drain:
                for n in range(runs):
                    await noop.defer_async(n=n)
                return {"seconds": time.monotonic() - t0, "own": 0}
            await app.run_worker_async(
                queues=["compare"], concurrency=threads, wait=False, install_signal_handlers=False
            )
            seconds = time.monotonic() - t0
            row = await app.connector.execute_query_one_async(
                "SELECT count(*) FILTER (WHERE type = 'succeeded') AS done,"
                " EXTRACT(EPOCH FROM max(at) FILTER (WHERE type = 'succeeded')"
                " - min(at) FILTER (WHERE type = 'started')) AS span"
                " FROM procrastinate_events"
            )
        if row["done"] != runs:
            raise RuntimeError(f"Procrastinate: {row['done']} of {runs} jobs succeeded")
        return {"seconds": seconds, "span": float(row["span"] or 0.0), "own": 1}

    return asyncio.run(main())


def enqueue_speed(url: str, db: str, calls: int, threads: int) -> dict[str, Any]:
    """Seconds of ``calls`` ``enqueue()`` calls (each its own transaction) and of one
    ``enqueue_many`` of as many calls, on our backend; nothing runs them."""
    _tasks_django(db, "k2b")
    from bench.tasks_app.tasks import noop
    from k2b_workflows.tasks import enqueue_many

    t0 = time.monotonic()
    for n in range(calls):
        noop.enqueue(n)
    one_by_one = time.monotonic() - t0
    t0 = time.monotonic()
    enqueue_many(noop, [((n,), None) for n in range(calls)])
    many = time.monotonic() - t0
    return {"seconds": many, "enqueue_s": one_by_one, "own": 0}


#: Each engine of ``--tasks``: its enqueue and its drain, each a process of its own.
TASK_ENGINES = {
    "k2b_workflows tasks": (k2b_tasks_enqueue, k2b_tasks_drain),
    # As many worker processes as django-tasks-db's drain has, the same threads in all.
    "k2b_workflows tasks (2 processes)": (
        k2b_tasks_enqueue,
        functools.partial(k2b_tasks_drain, processes=2),
    ),
    "django-tasks-db": (db_tasks_enqueue, db_tasks_drain),
    "Procrastinate jobs": (procrastinate_tasks_enqueue, procrastinate_tasks_drain),
}
CHILDREN = {
    **ENGINES,
    **{f"{name}/enqueue": fns[0] for name, fns in TASK_ENGINES.items()},
    **{f"{name}/drain": fns[1] for name, fns in TASK_ENGINES.items()},
    "enqueue_speed": enqueue_speed,
}


def run_task_engine(engine: str, url: str, runs: int, threads: int) -> dict[str, Any]:
    """One django.tasks engine on a fresh database: its enqueues, then its drain.

    The enqueues (one transaction each) and the drain (the engine's workers
    started on the full queue, stopped once it is empty) are measured apart,
    commits included, each less an idle run of the same process. Tasks/s is
    the drain's, from the first task's start to the last task's end as the
    engine records them: neither the enqueues nor the workers' start-up are
    in it, for any engine.
    """
    base = urlsplit(url).path.lstrip("/") or "k2b"
    db = base + "_cmp_" + re.sub(r"\W+", "_", engine.lower())
    admin_execute(url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)', f'CREATE DATABASE "{db}"')
    enqueue, drain = f"{engine}/enqueue", f"{engine}/drain"
    try:
        child(enqueue, url, db, 0, threads)  # installs the schema: not counted
        idle_enqueue = child(enqueue, url, db, 0, threads)
        idle_drain = child(drain, url, db, 0, threads)
        queued = child(enqueue, url, db, runs, threads)
        drained = child(drain, url, db, runs, threads)
    except RuntimeError as exc:
        return {"engine": engine, "version": version(engine), "error": str(exc)}
    finally:
        admin_execute(url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    return {
        "engine": engine,
        "version": version(engine),
        "tasks_per_s": round(runs / drained["span"], 1),
        "drain_wall_s": round(drained["seconds"], 2),
        "enqueues_per_s": round(queued.get("timed", runs) / queued["seconds"], 1),
        "enqueue_client_us": queued.get("client_us"),
        "enqueue_server_us": queued.get("server_us"),
        "commits_per_task": round((drained["commits"] - idle_drain["commits"]) / runs, 2),
        "enqueue_commits_per_task": round((queued["commits"] - idle_enqueue["commits"]) / runs, 2),
    }


def tasks_main(url: str, runs: int, threads: int, many: int, engines: list[str]) -> None:
    base = urlsplit(url).path.lstrip("/") or "k2b"
    rows = run_each(run_task_engine, engines, url, runs, threads)
    pg_db = f"{base}_cmp_pgbench"
    try:
        tps = pgbench(url, pg_db, 2, 5, say=lambda line: print(line, file=sys.stderr))
    finally:
        admin_execute(url, f'DROP DATABASE IF EXISTS "{pg_db}" WITH (FORCE)')
    speed_db = f"{base}_cmp_enqueue"
    admin_execute(
        url, f'DROP DATABASE IF EXISTS "{speed_db}" WITH (FORCE)', f'CREATE DATABASE "{speed_db}"'
    )
    try:
        speed: dict[str, Any] = child("enqueue_speed", url, speed_db, many, threads)
    except RuntimeError as exc:
        speed = {"error": str(exc)}
    finally:
        admin_execute(url, f'DROP DATABASE IF EXISTS "{speed_db}" WITH (FORCE)')
    print(
        f"\n{runs} no-op tasks on a full queue; same server, one invocation; pgbench c=2: "
        f"{tps} tps. tasks/s: from the first task's start to the last task's end as each "
        "engine records them (enqueues and worker start-up not included); commits/task: "
        "the drain's; enqueues: one transaction each, measured apart, with the CPU "
        "of the enqueuing process (client) and of its server backend (/proc) per enqueue\n"
    )
    print(
        "| engine | version | tasks/s | vs django-tasks-db | commits/task | "
        "tasks/s over pgbench tps | drain wall s | enqueues/s | commits/enqueue | "
        "client + server CPU µs/enqueue |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    peer = next((r for r in rows if r["engine"] == "django-tasks-db" and "error" not in r), None)
    for r in rows:
        if "error" in r:
            print(f"| {r['engine']} | {r['version']} | - | - | - | - | - | - | - | {r['error']} |")
            continue
        ratio = round(r["tasks_per_s"] / tps, 3) if tps else "-"
        times = f"{r['tasks_per_s'] / peer['tasks_per_s']:.1f}x" if peer else "-"
        print(
            f"| {r['engine']} | {r['version']} | {r['tasks_per_s']} | {times} | "
            f"{r['commits_per_task']} | {ratio} | {r['drain_wall_s']} | "
            f"{r['enqueues_per_s']} | {r['enqueue_commits_per_task']} | "
            f"{r['enqueue_client_us'] or '-'} + {r['enqueue_server_us'] or '-'} |"
        )
    if "error" in speed:
        print(f"\nenqueue_many: could not run: {speed['error']}")
    else:
        print(
            f"\n{many} enqueue() calls: {speed['enqueue_s']:.2f} s; enqueue_many of {many}: "
            f"{speed['seconds']:.2f} s ({speed['enqueue_s'] / speed['seconds']:.1f}x)"
        )
    print(json.dumps({"pgbench_tps": tps, "engines": rows, "enqueue": speed}))


def version(engine: str) -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version(PACKAGES[engine].replace("_", "-"))
    except PackageNotFoundError:
        return "not installed"


def measure(engine: str, url: str, runs: int, threads: int) -> dict[str, Any]:
    """Run one engine in a child process on a fresh database: its seconds and commits.

    The first child installs the schema (not counted); an idle one measures what
    the engine commits for nothing, taken off the measured run's commits.
    """
    base = urlsplit(url).path.lstrip("/") or "k2b"
    db = f"{base}_cmp_{engine.lower().replace(' ', '_').replace('-', '_')}"
    admin_execute(url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)', f'CREATE DATABASE "{db}"')
    try:
        child(engine, url, db, 0, threads)  # installs the schema: not counted
        idle = child(engine, url, db, 0, threads)
        row = child(engine, url, db, runs, threads)
    except RuntimeError as exc:
        return {"engine": engine, "version": version(engine), "error": str(exc)}
    finally:
        admin_execute(url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    return {
        "engine": engine,
        "version": version(engine),
        "seconds": row["seconds"],
        "commits": row["commits"] - idle["commits"],
    }


def run_engine(engine: str, url: str, runs: int, threads: int) -> dict[str, Any]:
    """One workflow engine on a fresh database: workflows/s, steps/s, commits per workflow."""
    row = measure(engine, url, runs, threads)
    if "error" in row:
        return row
    seconds, commits = row.pop("seconds"), row.pop("commits")
    return {
        **row,
        "workflows_per_s": round(runs / seconds, 1),
        "steps_per_s": round(runs * 3 / seconds, 1),
        "commits_per_workflow": round(commits / runs, 2),
    }


def run_each(
    run_one: Callable[[str, str, int, int], dict[str, Any]],
    engines: list[str],
    url: str,
    runs: int,
    threads: int,
) -> list[dict[str, Any]]:
    """Each engine's row, one after another; an engine that fails gets a row saying why."""
    rows = []
    for engine in engines:
        try:
            rows.append(run_one(engine, url, runs, threads))
        except Exception as exc:  # the table says why, the other engines still run
            rows.append({"engine": engine, "version": version(engine), "error": repr(exc)})
        print(f"{engine}: done", file=sys.stderr, flush=True)
    return rows


def child(engine: str, url: str, db: str, runs: int, threads: int) -> dict[str, Any]:
    """Start ``engine`` in a process of its own, run ``runs`` workflows, stop it.

    Returns the seconds it reported and the commits it made: the delta of
    ``xact_commit`` from before the process to after its last connection is
    gone (``settled_commits``), less the benchmark's own reads.
    """
    before = settled_commits(url, db)
    proc = subprocess.run(
        [
            *(sys.executable, __file__, "--child", engine, "--db", db),
            *("--runs", str(runs), "--threads", str(threads)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["no output"])[-1])
    row = json.loads(lines[-1])
    row["commits"] = settled_commits(url, db) - before - row.pop("own")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs", type=int, help="workflows per engine (300); --tasks: tasks (3000)"
    )
    parser.add_argument(
        "--threads", type=int, help="worker concurrency (2); --tasks: k2b's threads (8)"
    )
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated")
    parser.add_argument(
        "--tasks", action="store_true", help="the django.tasks path instead of workflows"
    )
    parser.add_argument(
        "--many", type=int, default=10_000, help="--tasks: calls of enqueue_many (10000)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    args = parser.parse_args()
    url = os.environ.get("DATABASE_URL")
    if not url:
        sys.exit("DATABASE_URL is not set")
    if args.runs is None:
        args.runs = 3000 if args.tasks else 300
    if args.threads is None:
        args.threads = 8 if args.tasks else 2
    if args.child:
        print(json.dumps(CHILDREN[args.child](url, args.db, args.runs, args.threads)))
        return
    if args.tasks:
        default = ",".join(ENGINES)
        names = list(TASK_ENGINES) if args.engines == default else args.engines.split(",")
        tasks_main(url, args.runs, args.threads, args.many, names)
        return
    rows = run_each(run_engine, args.engines.split(","), url, args.runs, args.threads)
    print(
        f"\n{args.runs} workflows x 3 steps, one worker process, concurrency {args.threads}, "
        "same server, one invocation; enqueues included\n"
    )
    print("| engine | version | workflows/s | steps/s | commits/workflow |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['engine']} | {r['version']} | - | - | could not run: {r['error']} |")
        else:
            print(
                f"| {r['engine']} | {r['version']} | {r['workflows_per_s']} | "
                f"{r['steps_per_s']} | {r['commits_per_workflow']} |"
            )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
