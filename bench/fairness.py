"""What fair shares cost the claim and the enqueue, against a backlog and idle keys (#50).

Usage: ``DATABASE_URL=postgres://... python bench/fairness.py [--backlog N]
[--idle-keys K] [--claims C]``

On a fresh database of its own (``<db>_fair`` on the server of
``DATABASE_URL``, dropped afterwards), for each of two tables: runs without a
key, then runs taking turns (``fairness_key``):

1. ``--backlog`` queued task runs of one key (``big``), inserted by one
   ``INSERT ... SELECT`` (so the place-in-line trigger runs once a row, as for a
   ``COPY``): **insert µs/run**;
2. ``--idle-keys`` keys with nothing ready (each one finished run);
3. five runs of another key (``small``) enqueued after the backlog;
4. ``VACUUM ANALYZE``, then **claim ms**: the median of ``--claims`` claims of one
   run (the worker's own statement, ``kernel/claim.py``), each rolled back so
   that every claim meets the same backlog, and the claim's shared buffers
   (``EXPLAIN (ANALYZE, BUFFERS)``);
5. **small served after**: claiming for real, how many claims until the five
   runs of ``small`` were all claimed (without keys: after the whole backlog,
   so not measured past 1,000 claims).

Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import admin_execute, with_db  # noqa: E402

WORKFLOWS = [("k2b.task.pure", 1)]

#: A queued task run of key %(key)s, as many as the parameter says: the columns a
#: claim reads (a claim checks no seal; the worker's load does, and none runs here).
_INSERT_SQL = """
INSERT INTO k2b_run (id, workflow_name, workflow_version, app_id, status, input, error_code,
       error_message, generation, consecutive_failures, run_after, claimed_by, wait_kind,
       wait_key, wait_signal_seq, created_at, updated_at, journal_anchor, ledger_anchor,
       start_seal, end_seal, holds_slot, priority, priority_credit_ms, deferred_by,
       wait_action, queue, task_path, fairness_key, fairness_weight, finished_at)
SELECT gen_random_uuid(), 'k2b.task.pure', 1, 'tasks', %(status)s::text, '{}', '', '', 0, 0, now(),
       '', '', '', 0, now(), now(), '', '', '', '', false, 100, 0, '', '', 'default',
       'bench.fair', %(key)s::text || CASE WHEN %(spread)s::boolean THEN n::text ELSE '' END, 1.0,
       CASE WHEN %(status)s::text = 'queued' THEN NULL ELSE now() END
  FROM generate_series(1, %(count)s) AS n
"""


def insert(
    cursor: Any, count: int, key: str | None, status: str = "queued", spread: bool = False
) -> float:
    """Insert ``count`` runs of ``key`` (None: without one); µs a run."""
    from django.db import transaction

    from k2b_workflows.kernel.starts import IGNORE_NOTHING_SQL

    started = time.perf_counter()
    with transaction.atomic():
        # As enqueue_many's COPY: the triggers' ignore check reads a set list.
        cursor.execute(IGNORE_NOTHING_SQL)
        cursor.execute(
            _INSERT_SQL
            if key is not None
            else _INSERT_SQL.replace(
                "%(key)s::text || CASE WHEN %(spread)s::boolean THEN n::text ELSE '' END", "NULL"
            ),
            {"count": count, "key": key, "status": status, "spread": spread},
        )
    return (time.perf_counter() - started) / count * 1e6


def claim_once(rollback: bool) -> list[Any]:
    from django.db import transaction

    from k2b_workflows.kernel import claim

    with transaction.atomic():
        rows = claim.claim_runs(
            "default", worker_id="bench", workflows=WORKFLOWS, app_ids=None, limit=1
        )
        if rollback:
            transaction.set_rollback(True)
    return rows


def claim_buffers() -> int:
    from django.db import connection, transaction

    from k2b_workflows.kernel import claim

    statement, params = claim.claim_statement("bench", WORKFLOWS, None, 1)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(claim.CLAIM_PLAN)
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + statement, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    found = re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", plan)
    if found is None:
        return -1
    return int(found.group(1)) + int(found.group(2) or 0)


def one_table(backlog: int, idle_keys: int, claims: int, fair: bool) -> dict[str, Any]:
    from django.db import connection

    with connection.cursor() as cursor:
        # The runs alone (nothing else was written): not the ORM's delete, which
        # looks for each run's journal, ledger and children first.
        cursor.execute("DELETE FROM k2b_run")
        cursor.execute("VACUUM k2b_run")
        insert_us = insert(cursor, backlog, "big" if fair else None)
        if idle_keys:
            insert(cursor, idle_keys, "idle" if fair else None, status="succeeded", spread=True)
        small_ids = set()
        for _ in range(5):
            insert(cursor, 1, "small" if fair else None)
            cursor.execute(
                "SELECT id FROM k2b_run WHERE status = 'queued' ORDER BY created_at DESC LIMIT 1"
            )
            small_ids.add(cursor.fetchone()[0])
        cursor.execute("VACUUM ANALYZE k2b_run")
    for _ in range(20):
        claim_once(rollback=True)  # warm
    timings = []
    for _ in range(claims):
        started = time.perf_counter()
        if not claim_once(rollback=True):
            raise RuntimeError("nothing to claim")
        timings.append((time.perf_counter() - started) * 1000)
    buffers = claim_buffers()
    served = None
    for n in range(1, 1001):
        rows = claim_once(rollback=False)
        small_ids -= {row[0] for row in rows}
        if not small_ids:
            served = n
            break
    return {
        "insert_us_per_run": round(insert_us, 1),
        "claim_ms_median": round(statistics.median(timings), 3),
        "claim_buffers": buffers,
        "small_served_after_claims": served,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backlog", type=int, default=1_000_000)
    parser.add_argument("--idle-keys", type=int, default=10_000)
    parser.add_argument("--claims", type=int, default=200)
    args = parser.parse_args()
    url = os.environ.get("DATABASE_URL")
    if not url:
        sys.exit("DATABASE_URL is not set")
    db = (url.rsplit("/", 1)[-1] or "k2b") + "_fair"
    admin_execute(url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)', f'CREATE DATABASE "{db}"')
    os.environ.update(
        {"DATABASE_URL": with_db(url, db), "DJANGO_SETTINGS_MODULE": "bench.settings"}
    )
    os.environ["K2B_BENCH_DB"] = db
    try:
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connection

        call_command("migrate", verbosity=0)
        report: dict[str, Any] = {"backlog": args.backlog, "idle_keys": args.idle_keys}
        for backlog in sorted({1_000, args.backlog}):
            for fair in (False, True):
                label = f"{'fair' if fair else 'plain'}_{backlog}"
                report[label] = one_table(backlog, args.idle_keys, args.claims, fair)
                print(label, report[label], flush=True)
        connection.close()
    finally:
        admin_execute(url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    print(json.dumps(report))


if __name__ == "__main__":
    main()
