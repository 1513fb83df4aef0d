"""What an idle fleet costs the database: statements, transactions, WAL and CPU a second.

Usage: ``DATABASE_URL=postgres://... python bench/idle.py [--processes 2]
[--concurrency 2] [--seconds 30] [--tree PATH]``. Creates ``<db>_idle`` on the
server of ``DATABASE_URL``, migrates it, starts one ``runworkflows --processes N
--concurrency C`` with nothing to run, lets it settle, and reads over
``--seconds``:

- **statements/s**: the calls ``pg_stat_statements`` counted in the database
  (when the server preloads it; else not shown), the workers' every statement;
- **transactions/s**: ``xact_commit + xact_rollback`` of the database, read from
  another database (a read-only statement outside a transaction is one too);
- **WAL bytes/s**: ``pg_current_wal_lsn()`` before and after (server-wide: measure
  on a quiet server);
- **CPU**: the workers' (the supervisor and its processes, from ``/proc``) and
  the server's (``run.ServerCpu``), in milliseconds a second.

``--tree PATH`` runs the workers of another checkout (``git worktree add``): the
same invocation can then compare two commits on one server, one after the other.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run import ServerCpu, _proc_cpu_s, admin_execute, with_db


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and every live descendant of it."""
    import psutil

    try:
        root = psutil.Process(pid)
        return sum(_proc_cpu_s(p.pid) for p in [root, *root.children(recursive=True)])
    except psutil.NoSuchProcess:
        return 0.0


def counters(url: str, db: str) -> dict[str, float | None]:
    import psycopg

    with psycopg.connect(with_db(url, "postgres"), autocommit=True) as conn:
        xacts, wal = conn.execute(
            "SELECT (SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s),"
            " pg_current_wal_lsn() - '0/0'::pg_lsn",
            [db],
        ).fetchone()
    statements = None
    # Not installed: statements are not counted.
    with (
        psycopg.connect(with_db(url, db), autocommit=True) as conn,
        contextlib.suppress(psycopg.Error),
    ):
        statements = conn.execute(
            "SELECT sum(calls) FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
            " WHERE d.datname = %s AND s.query NOT LIKE '%%pg_stat_statements%%'",
            [db],
        ).fetchone()[0]
    return {
        "xacts": float(xacts),
        "wal": float(wal),
        "statements": None if statements is None else float(statements),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    url = os.environ["DATABASE_URL"]
    db = Path(url.split("?")[0]).name + "_idle"
    admin_execute(url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)', f'CREATE DATABASE "{db}"')
    env = dict(os.environ, DATABASE_URL=with_db(url, db), PYTHONUNBUFFERED="1")
    import psycopg

    try:
        with psycopg.connect(with_db(url, db), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    except psycopg.Error:  # not installed: statements are not counted
        pass
    manage = [sys.executable, str(args.tree / "manage.py")]
    subprocess.run([*manage, "migrate", "-v0"], cwd=args.tree, env=env, check=True)
    worker = subprocess.Popen(
        [
            *manage,
            *("runworkflows", "--processes", str(args.processes)),
            *("--concurrency", str(args.concurrency)),
        ],
        cwd=args.tree,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server = ServerCpu(url)
    try:
        time.sleep(args.settle)  # start-up, registration, the first full passes
        before, cpu_w, cpu_s = counters(url, db), tree_cpu_s(worker.pid), server.read()
        started = time.monotonic()
        time.sleep(args.seconds)
        after, cpu_w2, cpu_s2 = counters(url, db), tree_cpu_s(worker.pid), server.read()
        seconds = time.monotonic() - started
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
        admin_execute(url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')

    def rate(key: str) -> float | None:
        a, b = before[key], after[key]
        return None if a is None or b is None else round((b - a) / seconds, 2)

    result = {
        "processes": args.processes,
        "concurrency": args.concurrency,
        "seconds": round(seconds, 1),
        # The two reads of the counters are themselves one transaction each.
        "transactions_per_s": rate("xacts"),
        "statements_per_s": rate("statements"),
        "wal_bytes_per_s": rate("wal"),
        "worker_cpu_ms_per_s": round((cpu_w2 - cpu_w) * 1000 / seconds, 1),
        "server_cpu_ms_per_s": (
            None if cpu_s is None or cpu_s2 is None else round((cpu_s2 - cpu_s) * 1000 / seconds, 1)
        ),
    }
    for key, value in result.items():
        print(f"{key:24} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
