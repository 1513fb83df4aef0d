"""A schedule pass over 10,000 schedules, few of them due, reads an index, not the table.

Every worker probes for due ticks about once a second and opens a pass when
one is due: both statements must cost the few due rows, whatever the number
of schedules, or the fleet's passes grow with the schedules nobody is firing.
"""

from __future__ import annotations

import json

import pytest
from django.db import connection, transaction

from k2b_workflows.kernel import schedule_passes, schedule_seals
from k2b_workflows.models import WorkflowRun, WorkflowSchedule

pytestmark = pytest.mark.django_db(transaction=True)

SCHEDULES = 10_000
DUE = 10


def _plan(sql: str, params: list) -> dict:
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", params)
        return cursor.fetchone()[0][0]["Plan"]


def _nodes(plan: dict) -> list[dict]:
    found = [plan]
    for child in plan.get("Plans", []):
        found += _nodes(child)
    return found


@pytest.fixture
def ten_thousand_schedules() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            """INSERT INTO k2b_schedule
                   (schedule_id, workflow_name, cron, every, timezone, input, catch_up, overlap,
                    paused, source, enabled, disabled_reason, anchor, next_tick, next_fire_at,
                    created_at, updated_at, seal)
               SELECT 'bulk-' || n, 'sched.echo', '', interval '1 hour', 'UTC', '{}', 'latest',
                      'allow', false, 'code', true, '', t - interval '1 hour', t, t,
                      k2b_now(), k2b_now(), ''
                 FROM generate_series(1, %s) n,
                      LATERAL (SELECT k2b_now() + CASE WHEN n <= %s THEN interval '-1 second'
                                      ELSE n * interval '1 minute' END AS t) due""",
            [SCHEDULES, DUE],
        )
    # Sealed as the key holder seals them (the pass refuses a row without a seal).
    rows = list(WorkflowSchedule.objects.filter(schedule_id__startswith="bulk-"))
    for row in rows:
        row.seal = schedule_seals.seal(row.sealed_values())
    WorkflowSchedule.objects.bulk_update(rows, ["seal"], batch_size=2000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE k2b_schedule")


def test_the_probe_and_the_pass_read_the_due_index_not_the_table(ten_thousand_schedules):
    names = ["sched.echo"]
    for sql, params in [
        (schedule_passes.PROBE_SQL, [names, names]),
        (
            schedule_passes.DUE_SQL.replace("FOR UPDATE SKIP LOCKED", ""),
            [names, schedule_passes.ROWS_PER_PASS],
        ),
    ]:
        plan = _plan(sql, params)
        nodes = _nodes(plan)
        scans = {(n["Node Type"], n.get("Relation Name"), n.get("Index Name")) for n in nodes}
        assert not any(kind == "Seq Scan" and rel == "k2b_schedule" for kind, rel, _ in scans), (
            json.dumps(plan, indent=1)
        )
        assert any(index == "k2b_schedule_due" for _, _, index in scans), json.dumps(plan, indent=1)
        # The index walk stops after the due rows (the probe: after the first one).
        walked = [n for n in nodes if n.get("Index Name") == "k2b_schedule_due"]
        assert all(n["Actual Rows"] <= DUE + 1 for n in walked), json.dumps(plan, indent=1)


def test_a_pass_over_ten_thousand_schedules_fires_only_the_due_ones(ten_thousand_schedules):
    result = schedule_passes.run_pass("default", {"sched.echo": {1}})

    assert (result.rows, result.started) == (DUE, DUE)
    assert WorkflowRun.objects.filter(schedule_id__startswith="bulk-").count() == DUE
    with transaction.atomic():
        assert schedule_passes.run_pass("default", {"sched.echo": {1}}).rows == 0
