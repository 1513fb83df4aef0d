"""A batch of no-op tasks drains as fast as the same calls without a batch (#50).

Usage: ``DATABASE_URL=postgres://... python bench/batches.py [--calls N] [--rounds R]
[--threads T]``

Each round, on a fresh database of its own (on the server of ``DATABASE_URL``,
created and dropped here): ``--calls`` no-op calls of one pure task, enqueued
with one ``enqueue_many`` (plain) or one ``enqueue_batch`` with an
``on_finish`` callback (batch), then drained by one ``runworkflows --burst``
process with ``--threads`` threads. The rate is the members' own: calls over
the span from the first call's start to the last call's end, as the runs
record them, so neither the enqueue nor the worker's start-up is in it. The
batch's line adds when its callback was enqueued (the batch's ``finished_at``)
after the last member's end, and how often the batch's row was updated
(``batch_row_updates``: 1, the pass that enqueued the callback; a counter
design would read 10,000). Plain and batch rounds alternate, and the
medians are compared: ``ratio`` = batch rate / plain rate. Prints one JSON
object last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

ROOT = Path(__file__).resolve().parent.parent

#: The members' span: the first call's start (its journal entry) to the last's end.
SPAN_SQL = """
SELECT count(*), EXTRACT(EPOCH FROM max(r.finished_at) - min(j.started_at))
  FROM k2b_run r JOIN k2b_journal j ON j.run_id = r.id AND j.seq = 0
 WHERE r.status = 'succeeded' AND r.task_path = 'bench.tasks_app.tasks.noop'
"""
#: When the callback was enqueued, after the last member's end (seconds).
CALLBACK_SQL = """
SELECT EXTRACT(EPOCH FROM b.finished_at - (SELECT max(finished_at) FROM k2b_run
                                           WHERE task_path = 'bench.tasks_app.tasks.noop')),
       (SELECT count(*) FROM k2b_run WHERE task_path = 'bench.tasks_app.tasks.batch_done')
  FROM k2b_task_batch b
"""

#: Updates of the batch table's rows over the round (one batch: its row's updates).
BATCH_ROW_UPDATES_SQL = """
SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'k2b_task_batch'
"""


def _server(url: str, db: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{db}"))


def _admin(url: str, *statements: str) -> None:
    with psycopg.connect(_server(url, "postgres"), autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


def enqueue(kind: str, calls: int) -> None:
    """In a child process on ``K2B_BENCH_DB``: migrate, then enqueue the calls."""
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from bench.tasks_app.tasks import batch_done, noop
    from k2b_workflows.tasks import enqueue_batch, enqueue_many

    pairs = [((n,), None) for n in range(calls)]
    if kind == "batch":
        enqueue_batch(noop, pairs, on_finish=batch_done)
    else:
        enqueue_many(noop, pairs)


def one_round(url: str, kind: str, calls: int, threads: int) -> dict[str, Any]:
    db = (urlsplit(url).path.lstrip("/") or "k2b") + "_bench_batches"
    _admin(url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)', f'CREATE DATABASE "{db}"')
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.tasks_app.settings",
        "K2B_BENCH_DB": db,
        "K2B_BENCH_TASKS": "k2b",
        "PYTHONUNBUFFERED": "1",
    }
    try:
        subprocess.run(
            [sys.executable, __file__, "--enqueue", kind, "--calls", str(calls)],
            cwd=ROOT,
            env=env,
            check=True,
        )
        t0 = time.monotonic()
        subprocess.run(
            [
                *(sys.executable, str(ROOT / "manage.py"), "runworkflows", "--burst"),
                *("--app", "tasks", "--concurrency", str(threads)),
            ],
            cwd=ROOT,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=3600,
        )
        wall = time.monotonic() - t0
        with psycopg.connect(_server(url, db)) as conn:
            done, span = conn.execute(SPAN_SQL).fetchone()
            row: dict[str, Any] = {
                "kind": kind,
                "done": done,
                "span_s": round(float(span), 3),
                "per_s": round(calls / float(span), 1),
                "wall_s": round(wall, 2),
            }
            if kind == "batch":
                after, callbacks = conn.execute(CALLBACK_SQL).fetchone()
                row["callback_after_last_end_s"] = None if after is None else round(float(after), 3)
                row["callback_runs"] = callbacks
                # No hot row: the batch's row is written once, when its callbacks are
                # enqueued, not at each member's end (the workers have exited: their
                # statistics are flushed).
                row["batch_row_updates"] = conn.execute(BATCH_ROW_UPDATES_SQL).fetchone()[0]
        if done != calls:
            raise RuntimeError(f"{done} of {calls} calls succeeded")
        return row
    finally:
        _admin(url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--enqueue", choices=("plain", "batch"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.enqueue:
        sys.path.insert(0, str(ROOT))
        enqueue(args.enqueue, args.calls)
        return
    url = os.environ["DATABASE_URL"]
    rounds: dict[str, list[dict[str, Any]]] = {"plain": [], "batch": []}
    for _ in range(args.rounds):
        for kind in ("plain", "batch"):
            row = one_round(url, kind, args.calls, args.threads)
            print(json.dumps(row), flush=True)
            rounds[kind].append(row)
    plain = round(statistics.median(r["per_s"] for r in rounds["plain"]), 1)
    batch = round(statistics.median(r["per_s"] for r in rounds["batch"]), 1)
    print(
        json.dumps(
            {
                "calls": args.calls,
                "threads": args.threads,
                "plain_per_s": plain,
                "batch_per_s": batch,
                "ratio": round(batch / plain, 3),
                "rounds": rounds,
            }
        )
    )


if __name__ == "__main__":
    main()
