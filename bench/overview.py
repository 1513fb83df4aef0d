"""Time the admin's overview on a table of 1,000,000 runs (``make bench-overview``).

Usage: ``DATABASE_URL=postgres://... python bench/overview.py [--runs N] [--recent N]``.
Creates ``<db>_overview`` on the server of ``DATABASE_URL`` (dropped afterwards),
fills it with ``--runs`` runs (default 1,000,000) spread over 30 days, of which
``--recent`` (default 20,000) started and ended within the last hour, plus
queued, waiting and needs_attention runs, vacuums and analyzes it as autovacuum
would, then reads ``overview.read()`` for the hour and the day: once (the first page
reads its whole window from the runs table and rolls its minutes up), then
``--repeat`` times, and prints the first, the median and the slowest, and the
plans of the reads of the whole window. The last line
is one JSON object with the numbers.

The rows are written with SQL (``generate_series``), not by running
workflows: what is timed is reading, and the reads do not care how the rows
came to be (they carry no seals: ``verifyworkflows`` would call them tampered).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: One INSERT of ``n`` runs: status, error code, created and finished times by formula.
#: ``%(n)s`` rows from ``%(offset)s``; their ages spread over ``%(span)s`` seconds.
SEED_SQL = """
INSERT INTO k2b_run (id, workflow_name, workflow_version, app_id, status, input, error_code,
                     error_message, generation, consecutive_failures, run_after, claimed_by,
                     wait_kind, wait_key, wait_signal_seq, created_at, updated_at, finished_at,
                     journal_anchor, ledger_anchor, start_seal, end_seal, root_id,
                     holds_slot, priority, priority_credit_ms, deferred_by, wait_action)
SELECT id, 'bench.seeded', 1, 'bench', status,
       '{}'::jsonb,
       CASE WHEN status = 'failed' THEN (ARRAY['CARD_DECLINED', 'WORKFLOW_RETRY_EXHAUSTED',
                                              'EFFECT_BUDGET_EXCEEDED'])[1 + i %% 3]
            WHEN status = 'needs_attention' THEN 'EFFECT_OUTCOME_UNKNOWN'
            WHEN status = 'canceled' THEN 'CANCELED' ELSE '' END,
       '', 1, 0, created, '', '', '', 0, created, created + interval '2 seconds',
       CASE WHEN status IN ('succeeded', 'failed', 'canceled')
            THEN created + interval '2 seconds' END,
       '', '', '', '', id, false, 0, 0, '', ''
  FROM (SELECT gen_random_uuid() AS id, i,
               CASE WHEN i %% 50 = 0 THEN 'failed' WHEN i %% 97 = 0 THEN 'canceled'
                    ELSE 'succeeded' END AS status,
               %(now)s - (%(span)s * random() + 2) * interval '1 second' AS created
          FROM generate_series(%(offset)s, %(offset)s + %(n)s - 1) i) s
"""

#: Runs that are active now: queued (some due, some later), waiting, in doubt.
ACTIVE_SQL = """
INSERT INTO k2b_run (id, workflow_name, workflow_version, app_id, status, input, error_code,
                     error_message, generation, consecutive_failures, run_after, claimed_by,
                     wait_kind, wait_key, wait_signal_seq, created_at, updated_at,
                     journal_anchor, ledger_anchor, start_seal, end_seal, root_id,
                     holds_slot, priority, priority_credit_ms, deferred_by, wait_action)
SELECT id, 'bench.seeded', 1, 'bench', status, '{}'::jsonb,
       CASE WHEN status = 'needs_attention' THEN 'EFFECT_OUTCOME_UNKNOWN' ELSE '' END,
       '', 1, 0,
       %(now)s + CASE WHEN i %% 2 = 0 THEN interval '-1 minute' ELSE interval '1 hour' END,
       '', CASE WHEN status = 'waiting' THEN 'signal' ELSE '' END,
       CASE WHEN status = 'waiting' THEN 'k' || i ELSE '' END,
       0, %(now)s - interval '1 minute', %(now)s, '', '', '', '', id, false, 0, 0, '', ''
  FROM (SELECT gen_random_uuid() AS id, i,
               (ARRAY['queued', 'queued', 'waiting', 'needs_attention'])[1 + i %% 4] AS status
          FROM generate_series(1, %(n)s) i) s
"""


def seed(cursor, *, runs: int, recent: int, active: int, now, days: int = 30) -> None:
    """Insert ``runs`` finished runs (``recent`` of them in the last hour) and ``active`` others.

    Run on a connection with ``session_replication_role = replica`` (no status
    trigger, no notification per row): the rows are what a day of real runs
    leaves, inserted in one statement per 100,000.
    """
    old = runs - recent
    for offset in range(0, old, 100_000):
        n = min(100_000, old - offset)
        cursor.execute(SEED_SQL, {"n": n, "offset": offset, "span": days * 86400, "now": now})
    for offset in range(0, recent, 100_000):
        n = min(100_000, recent - offset)
        cursor.execute(SEED_SQL, {"n": n, "offset": old + offset, "span": 3400, "now": now})
    if active:
        cursor.execute(ACTIVE_SQL, {"n": active, "now": now})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--recent", type=int, default=20_000)
    parser.add_argument("--active", type=int, default=2_000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    url = os.environ.get("DATABASE_URL")
    if not url:
        sys.exit("DATABASE_URL is not set")
    from bench.run import admin_execute

    db = f"{urlsplit(url).path.lstrip('/') or 'k2b'}_overview"
    admin_execute(url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)', f'CREATE DATABASE "{db}"')
    os.environ.update({"DJANGO_SETTINGS_MODULE": "bench.settings", "K2B_BENCH_DB": db})
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection, transaction

    from k2b_workflows.admin import overview

    try:
        call_command("migrate", verbosity=0)
        started = time.perf_counter()
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL session_replication_role = replica")
            cursor.execute("SELECT k2b_now()")
            (now,) = cursor.fetchone()
            seed(cursor, runs=args.runs, recent=args.recent, active=args.active, now=now)
        with connection.cursor() as cursor:
            cursor.execute("VACUUM (ANALYZE) k2b_run")
            cursor.execute(
                "SELECT count(*), pg_size_pretty(pg_total_relation_size('k2b_run')) FROM k2b_run"
            )
            total, size = cursor.fetchone()
        print(f"seeded {total:,} runs ({size}) in {time.perf_counter() - started:.0f} s")
        results = {}
        for window in overview.WINDOWS:
            # The first page reads the whole window from the runs table (and rolls it up).
            t0 = time.perf_counter()
            overview.read(window)
            first_ms = round((time.perf_counter() - t0) * 1000, 1)
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                view = overview.read(window)
                times.append((time.perf_counter() - t0) * 1000)
            results[window] = {
                "first_ms": first_ms,
                "median_ms": round(statistics.median(times), 1),
                "max_ms": round(max(times), 1),
                "started": sum(view.started_per_minute),
                "finished": sum(view.finished_per_minute),
            }
            print(
                f"overview, {window}: first page {first_ms} ms, then "
                f"median {results[window]['median_ms']} ms, "
                f"slowest {results[window]['max_ms']} ms of {args.repeat} "
                f"({results[window]['started']:,} started, {results[window]['finished']:,} "
                "finished in the window)"
            )
        with connection.cursor() as cursor:
            cursor.execute("SELECT k2b_now()")
            params = overview.parameters("day", cursor.fetchone()[0])
            for name, sql in overview.STATEMENTS.items():
                cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
                plan = "\n".join(row[0] for row in cursor.fetchall())
                print(f"-- {name} (day)\n{plan}")
        print(json.dumps({"runs": total, "table_size": size, **results}))
    finally:
        connection.close()
        admin_execute(url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


if __name__ == "__main__":
    main()
