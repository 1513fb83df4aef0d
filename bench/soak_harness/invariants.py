"""What the database shows after a soak: each invariant's offending rows, and the takeovers.

Everything is read back from the soak's tables (``cluster.TABLES``) and the
kernel's, after the drain: what the provider recorded of each call, the claims
and takeovers the triggers recorded with their commit times, and the chaos the
harness did (``soak_chaos``). A call is *in flight* from the moment the
provider saw it until it returned to its caller, or until its process was
SIGKILLed: a call whose process was only frozen, or lost its lease while
alive, is still in flight, and another holder must not act on its step then.
"""

from __future__ import annotations

import datetime as dt
import itertools
from collections.abc import Sequence
from typing import Any

SETTLED = ("succeeded", "failed", "canceled", "needs_attention")
TASK_WORKFLOWS = ("k2b.task.pure", "k2b.task.idempotent", "k2b.task.external")

#: Each must be 0 (``unchecked_writes`` is a count; the others are lists).
INVARIANTS = (
    "lost",
    "stuck",
    "duplicate_effects",
    "missing_effects",
    "changed_effect_keys",
    "raced_effects",
    "wrong_ends",
    "stale_writes",
    "unchecked_writes",
    "broken_chains",
    "unexpected_attention",
    "died_on_their_own",
    "unclean_stops",
)

#: Until when a call of the provider (``p``, its pid column ``p.pid``) was in flight:
#: its return, else its process's SIGKILL, else for ever (alive, or frozen).
_IN_FLIGHT_UNTIL = """COALESCE({left}, (SELECT min(x.at) FROM soak_chaos x
                              WHERE x.kind = 'kill' AND x.pid = {alias}.pid
                                AND x.at >= {entered}), 'infinity')"""
_CALL_UNTIL = _IN_FLIGHT_UNTIL.format(left="p.left_at", alias="p", entered="p.created_at")

#: The pid in a worker id (``host:pid:suffix``, worker/loop.py).
_PID_OF = "(regexp_match({}, ':([0-9]+):[0-9a-f]+$'))[1]::int"

_DUPLICATES_SQL = """
SELECT 'external', effect_key, count(*) FROM soak_provider_call
 GROUP BY effect_key HAVING count(*) > 1
UNION ALL
SELECT kind, effect_key, count(*) FROM soak_effect
 GROUP BY kind, effect_key HAVING count(*) > 1
UNION ALL
SELECT 'task external', run_id::text, count(*) FROM soak_task_call
 WHERE effect = 'external' GROUP BY run_id HAVING count(*) > 1
"""

_MISSING_SQL = """
SELECT 'journaled without its effect', j.run_id, j.seq, j.action_name
  FROM k2b_journal j
 WHERE j.state = 'succeeded' AND (
       (j.action_name IN ('soak.write_row', 'soak.send_notice') AND NOT EXISTS
         (SELECT 1 FROM soak_effect e WHERE e.run_id = j.run_id AND e.seq = j.seq))
    OR (j.action_name IN ('soak.charge', 'soak.charge_blind') AND NOT EXISTS
         (SELECT 1 FROM soak_provider_call p WHERE p.run_id = j.run_id AND p.seq = j.seq)))
UNION ALL
SELECT 'transactional effect without its journal entry', e.run_id, e.seq, e.kind
  FROM soak_effect e
 WHERE e.kind = 'transactional' AND NOT EXISTS
       (SELECT 1 FROM k2b_journal j WHERE j.run_id = e.run_id AND j.seq = e.seq)
UNION ALL
SELECT 'task succeeded without a call that returned', r.id, 0, r.workflow_name
  FROM k2b_run r
 WHERE r.workflow_name = ANY(%s) AND r.status = 'succeeded' AND NOT EXISTS
       (SELECT 1 FROM soak_task_call c WHERE c.run_id = r.id AND c.left_at IS NOT NULL)
"""

_CHANGED_KEYS_SQL = """
SELECT 'idempotent task called under several effect keys', run_id::text,
       array_agg(DISTINCT effect_key)
  FROM soak_task_call WHERE effect = 'idempotent'
 GROUP BY run_id HAVING count(DISTINCT effect_key) > 1
UNION ALL
SELECT 'one effect key for several task calls', effect_key, array_agg(DISTINCT run_id::text)
  FROM soak_task_call GROUP BY effect_key HAVING count(DISTINCT run_id) > 1
"""

#: A reconcile by a later holder that asked while the step's call was still in flight
#: (or before it came in): it answered for a call that had not finished.
_RACED_SQL = f"""
SELECT 'reconciled while its call was in flight', r.run_id, r.seq, r.generation, r.found,
       r.at, p.generation, p.pid, p.created_at, p.left_at
  FROM soak_reconcile r JOIN soak_provider_call p ON p.effect_key = r.effect_key
 WHERE p.generation < r.generation AND {_CALL_UNTIL} > r.at
UNION ALL
SELECT 'two calls of one external task at once', a.run_id, 0, a.generation, NULL,
       b.entered_at, b.generation, b.pid, a.entered_at, a.left_at
  FROM soak_task_call a JOIN soak_task_call b
    ON a.run_id = b.run_id AND a.effect = 'external' AND b.effect = 'external'
   AND a.token < b.token
 WHERE a.entered_at < {_IN_FLIGHT_UNTIL.format(left="b.left_at", alias="b", entered="b.entered_at")}
   AND b.entered_at < {_IN_FLIGHT_UNTIL.format(left="a.left_at", alias="a", entered="a.entered_at")}
"""

_WRONG_ENDS_SQL = """
SELECT 'failed PROVIDER_ABSENT, but the provider has the call', r.id, r.workflow_name,
       r.error_code, (SELECT count(*) FROM soak_provider_call p
                       WHERE p.run_id = r.id AND p.action = 'soak.charge')
  FROM k2b_run r
 WHERE r.status = 'failed' AND r.error_code = 'PROVIDER_ABSENT' AND EXISTS
       (SELECT 1 FROM soak_provider_call p WHERE p.run_id = r.id AND p.action = 'soak.charge')
UNION ALL
SELECT 'task failed (its function never raises)', r.id, r.workflow_name, r.error_code,
       (SELECT count(*) FROM soak_task_call c WHERE c.run_id = r.id)
  FROM k2b_run r
 WHERE r.workflow_name = ANY(%s) AND r.status IN ('failed', 'canceled')
"""

#: Each run needing attention, with what its step did and whether the chaos hit the
#: holder of the doubted dispatch between that dispatch's commit and the next claim.
_ATTENTION_SQL = f"""
WITH attention AS (
    SELECT r.id, r.workflow_name, r.error_code, r.attention_step,
           d.action_name, d.generation, pg_xact_commit_timestamp(d.xmin) AS dispatched_at
      FROM k2b_run r
      LEFT JOIN LATERAL (SELECT l.action_name, l.generation, l.xmin FROM k2b_ledger l
                          WHERE l.run_id = r.id AND l.seq = r.attention_step
                            AND l.kind = 'dispatched' ORDER BY l.id DESC LIMIT 1) d ON true
     WHERE r.status = 'needs_attention'),
holders AS (
    SELECT a.*, {_PID_OF.format("c.claimed_by")} AS holder_pid,
           COALESCE((SELECT pg_xact_commit_timestamp(n.xmin) FROM soak_claim n
                      WHERE n.run_id = a.id AND n.generation > a.generation
                      ORDER BY n.generation LIMIT 1), 'infinity') AS taken_at
      FROM attention a
      LEFT JOIN soak_claim c ON c.run_id = a.id AND c.generation = a.generation)
SELECT h.id, h.workflow_name, h.error_code, h.attention_step, h.action_name,
       CASE WHEN h.workflow_name = 'k2b.task.external'
            THEN (SELECT count(*) FROM soak_task_call c WHERE c.run_id = h.id)
            ELSE (SELECT count(*) FROM soak_provider_call p
                   WHERE p.run_id = h.id AND p.seq = h.attention_step) END AS calls,
       (SELECT string_agg(DISTINCT x.kind, ',') FROM soak_chaos x
         WHERE x.at BETWEEN h.dispatched_at - interval '1 second'
                        AND h.taken_at + interval '1 second'
           AND (x.pid = h.holder_pid OR x.kind IN ('terminate', 'restart'))) AS cut_by,
       h.holder_pid,
       (SELECT bool_or(t.live) FROM soak_takeover t
         WHERE t.run_id = h.id AND t.generation = h.generation) AS kernel_saw_alive,
       h.dispatched_at, NULLIF(h.taken_at, 'infinity') AS taken_at,
       (SELECT min(c.entered_at) FROM soak_task_call c WHERE c.run_id = h.id) AS call_entered,
       (SELECT max(c.left_at) FROM soak_task_call c WHERE c.run_id = h.id) AS call_left,
       (SELECT min(p.created_at) FROM soak_provider_call p
         WHERE p.run_id = h.id AND p.seq = h.attention_step) AS provider_entered,
       (SELECT max(p.left_at) FROM soak_provider_call p
         WHERE p.run_id = h.id AND p.seq = h.attention_step) AS provider_left
  FROM holders h
"""

#: Every takeover; whether the harness had killed or frozen its holder shortly before
#: (if not, the holder was alive: it lost the run to a late renewal); and whether the
#: holder was inside an external call, or between an external step's dispatch and
#: its end, when the reap took the run.
_TAKEOVERS_SQL = f"""
SELECT t.run_id, r.workflow_name, t.step, t.holder,
       NOT EXISTS (SELECT 1 FROM soak_chaos x
                    WHERE x.kind IN ('kill', 'freeze') AND x.pid = {_PID_OF.format("t.holder")}
                      AND x.at BETWEEN t.at - interval '15 seconds' AND t.at) AS alive,
       t.at, t.generation,
       r.status, r.error_code,
       (SELECT count(*) FROM soak_provider_call p
         WHERE p.run_id = t.run_id AND p.generation = t.generation AND p.created_at <= t.at
           AND (p.left_at IS NULL OR p.left_at >= t.at))
     + (SELECT count(*) FROM soak_task_call c
         WHERE c.run_id = t.run_id AND c.effect = 'external' AND c.generation = t.generation
           AND c.entered_at <= t.at AND (c.left_at IS NULL OR c.left_at >= t.at)) AS in_call,
       EXISTS (SELECT 1 FROM k2b_ledger l
                WHERE l.run_id = t.run_id AND l.seq = t.step AND l.kind = 'dispatched'
                  AND l.generation = t.generation
                  AND pg_xact_commit_timestamp(l.xmin) <= t.at)
       AND NOT EXISTS (SELECT 1 FROM k2b_journal j
                        WHERE j.run_id = t.run_id AND j.seq = t.step
                          AND j.generation = t.generation
                          AND pg_xact_commit_timestamp(j.xmin) <= t.at) AS in_step,
       t.live AS kernel_saw_alive
  FROM soak_takeover t JOIN k2b_run r ON r.id = t.run_id
 ORDER BY t.at
"""


def record_chaos(events: Sequence[tuple[float, str, int | None]], using: str = "default") -> None:
    """Write the harness's chaos (wall-clock time, kind, pid) where the checks read it."""
    from django.db import connections

    rows = [(dt.datetime.fromtimestamp(at, dt.UTC), kind, pid) for at, kind, pid in events]
    with connections[using].cursor() as cursor:
        cursor.executemany("INSERT INTO soak_chaos (at, kind, pid) VALUES (%s, %s, %s)", rows)


def findings(
    started: int,
    using: str = "default",
    *,
    enqueued: int = 0,
    schedules: dict[str, float] | None = None,
) -> dict[str, Any]:
    """What the database shows after the soak: each invariant's offending rows, and counts.

    ``started`` root runs and ``enqueued`` task calls were started by the harness;
    ``schedules`` are the task schedules it made (id -> seconds between ticks).
    ``lost`` holds one item per missing run or call and per missed tick;
    ``unchecked_writes`` is a one-item list of a count.
    """
    from django.db import connections

    from bench.soak_app.workflows import MIX
    from k2b_workflows.kernel import evidence
    from k2b_workflows.models import WorkflowRun

    connection = connections[using]

    def rows(sql: str, params: list[Any] | None = None) -> list[tuple]:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall())

    def records(sql: str) -> list[dict[str, Any]]:
        with connection.cursor() as cursor:
            cursor.execute(sql)
            names = [column.name for column in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    tasks = list(TASK_WORKFLOWS)
    runs = WorkflowRun.objects.using(using)
    roots = runs.filter(parent__isnull=True, workflow_name__in=list(MIX)).count()
    lost: list[Any] = [("root runs started", started, "found", roots)] * abs(started - roots)
    recorded = rows("SELECT count(*) FROM soak_task_enqueued")[0][0]
    lost += [("task calls enqueued", enqueued, "recorded", recorded)] * abs(enqueued - recorded)
    lost += rows(
        """SELECT 'task call without its run', e.call, e.effect, e.how FROM soak_task_enqueued e
            WHERE NOT EXISTS (SELECT 1 FROM k2b_run r WHERE r.id = e.run_id)"""
    )
    lost += missed_ticks(rows, schedules or {})
    stuck = rows(
        """SELECT id, workflow_name, status, claimed_by, current_step, generation,
                  consecutive_failures, error_message, queue, concurrency_key, holds_slot,
                  extract(epoch FROM run_after - k2b_now()) AS due_in_s,
                  extract(epoch FROM k2b_now() - updated_at) AS untouched_s
             FROM k2b_run
            WHERE status <> ALL(%s)""",
        [list(SETTLED)],
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
    attention = records(_ATTENTION_SQL)
    return {
        "lost": lost,
        "stuck": stuck,
        "duplicate_effects": rows(_DUPLICATES_SQL),
        "missing_effects": rows(_MISSING_SQL, [tasks]),
        "changed_effect_keys": rows(_CHANGED_KEYS_SQL),
        "raced_effects": rows(_RACED_SQL),
        "wrong_ends": rows(_WRONG_ENDS_SQL, [tasks]),
        "stale_writes": stale,
        "unchecked_writes": [sum(r[0] for r in unchecked)],
        "broken_chains": broken,
        "unexpected_attention": [a for a in attention if not expected_attention(a)],
        "attention": attention,
        "takeovers": rows(_TAKEOVERS_SQL),
        "provider_calls": rows("SELECT count(*) FROM soak_provider_call")[0][0],
        "task_calls": dict(rows("SELECT effect, count(*) FROM soak_task_call GROUP BY effect")),
        "tasks_enqueued": dict(
            rows("SELECT how, count(*) FROM soak_task_enqueued GROUP BY how ORDER BY how")
        ),
        "effects": rows("SELECT count(*) FROM soak_effect")[0][0],
        "hogs_held": rows("SELECT count(*) FROM soak_hog")[0][0],
        "claims": rows("SELECT count(*) FROM soak_claim")[0][0],
    }


def expected_attention(row: dict[str, Any]) -> bool:
    """An incident is expected only for an EXTERNAL call without ``reconcile()`` that the
    chaos cut: outcome unknown, at most one call of it, its holder killed or frozen (or
    the database cut from under it) between its dispatch and the next claim."""
    external = row["workflow_name"] == "k2b.task.external" or (
        row["action_name"] == "soak.charge_blind"
    )
    return (
        external
        and row["error_code"] == "EFFECT_OUTCOME_UNKNOWN"
        and row["calls"] <= 1
        and bool(row["cut_by"])
    )


def missed_ticks(rows: Any, schedules: dict[str, float]) -> list[tuple]:
    """Ticks of the task schedules (``catch_up="all"``, ``overlap="allow"``) that started
    no run: a gap between two consecutive runs' ``scheduled_for`` wider than the period."""
    missed = []
    for schedule_id, seconds in schedules.items():
        ticks = [
            row[0]
            for row in rows(
                "SELECT scheduled_for FROM k2b_run WHERE schedule_id = %s ORDER BY scheduled_for",
                [schedule_id],
            )
        ]
        if not ticks:
            state = rows(
                """SELECT enabled, disabled_reason, paused, anchor, next_tick, next_fire_at,
                          last_tick, created_at, k2b_now() FROM k2b_schedule
                    WHERE schedule_id = %s""",
                [schedule_id],
            )
            missed.append(("schedule started no run", schedule_id, *state))
        for before, after in itertools.pairwise(ticks):
            gap = (after - before).total_seconds()
            if abs(gap - seconds) > 0.001:
                missed.append(("schedule gap", schedule_id, before.isoformat(), gap))
    return missed


def takeover_summary(found: dict[str, Any]) -> dict[str, Any]:
    """The takeovers of live holders, and what became of their runs.

    A live holder lost its run because its lease could not be renewed in time: a
    holder the harness had not killed or frozen in the 15 seconds before. The
    kernel's reap may not know it alive (``HOLDER_WAS_ALIVE`` wants a heartbeat
    after the lease expired, and a starved worker beats late too):
    ``kernel_saw_alive`` counts those it did. Each is reported with where its
    holder was (inside an external call; between an external step's dispatch
    and its end) and whether its run is among those that ended wrongly,
    repeated an effect or raced one.
    """
    takeovers = found["takeovers"]
    live = [t for t in takeovers if t[4]]

    def runs_in(name: str) -> set[str]:
        return {str(item[1]) for item in found[name]}

    def attention_runs() -> set[str]:
        return {str(item["id"]) for item in found["unexpected_attention"]}

    def effect_runs() -> set[str]:
        keys = {str(item[1]) for item in found["duplicate_effects"]}
        return {k.split(":", 1)[0] for k in keys}

    wrong = runs_in("wrong_ends") | attention_runs()
    repeated, raced = effect_runs(), runs_in("raced_effects")
    details = [
        {
            "run": str(t[0]),
            "workflow": t[1],
            "step": t[2],
            "holder": t[3],
            "at": t[5].isoformat(),
            "generation": t[6],
            "ended": f"{t[7]} {t[8]}".strip(),
            "in_external_call": bool(t[9]),
            "in_external_step": bool(t[10]),
            "kernel_saw_alive": bool(t[11]),
            "ended_wrongly": str(t[0]) in wrong,
            "repeated": str(t[0]) in repeated,
            "raced": str(t[0]) in raced,
        }
        for t in live
    ]
    return {
        "takeovers": len(takeovers),
        "live_takeovers": len(live),
        "live_kernel_saw_alive": sum(d["kernel_saw_alive"] for d in details),
        "live_in_external_call": sum(d["in_external_call"] for d in details),
        "live_in_external_step": sum(d["in_external_step"] for d in details),
        "live_ended_wrongly": sum(d["ended_wrongly"] for d in details),
        "live_repeated": sum(d["repeated"] for d in details),
        "live_raced": sum(d["raced"] for d in details),
        "live_details": details,
    }
