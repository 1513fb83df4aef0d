"""Schedules across a fleet of real workers: one run per tick through SIGKILL and a restart.

Three ``runworkflows`` processes run schedule passes against a PostgreSQL
cluster of the test's own (``tests/support/pgcluster.py``). One is SIGKILLed just
after a tick (when the passes run), the cluster is crash-restarted
(stopped ``-m immediate`` for three ticks, then started), and at the end every tick of the
one-second schedule from its first to its last has exactly one run: none
twice (the lock and the key), none lost (``catch_up="all"`` fires the ticks
that fell while the database was down).
"""

from __future__ import annotations

import datetime as dt
import json
import signal
import time

import pytest

from tests.support import pgcluster
from tests.support.pgcluster import Cluster, django_script
from tests.support.processes import wait_for

pytestmark = [pytest.mark.crash, pytest.mark.slow]

TIMEOUT = 240  # the machine is shared; nothing here is a timing assertion
TICKS = 32


# A cluster of the module's own with a migrated template, a fresh copy of it for each
# test, and the workers a test starts, closed after it.
cluster = pgcluster.template_cluster
database = pgcluster.template_copy
workers = pgcluster.workers


def fired(cluster: Cluster, database: str) -> int:
    return cluster.sql(
        "SELECT count(*) FROM k2b_run WHERE schedule_id = 'fleet'", database=database
    )[0][0]


def until_after_a_tick(cluster: Cluster, database: str) -> None:
    """Sleep to 10 ms after the next tick (the schedule's ticks are on the anchor's grid)."""
    ((left,),) = cluster.sql(
        "SELECT EXTRACT(EPOCH FROM next_fire_at - clock_timestamp()) FROM k2b_schedule"
        " WHERE schedule_id = 'fleet'",
        database=database,
    )
    time.sleep(max(float(left), 0.0) + 0.01)


def test_three_workers_start_exactly_one_run_per_tick_through_a_kill_and_a_restart(
    cluster, database, workers
):
    url = cluster.url(database)
    fleet = [workers(url, "--concurrency", "2") for _ in range(3)]
    wait_for(
        lambda: all(" thread(s), apps " in w.output() for w in fleet),
        timeout=TIMEOUT,
        message="every worker to start",
    )
    django_script(
        url,
        "import datetime as dt\n"
        "from k2b_workflows import Schedule, schedule_workflow\n"
        "schedule_workflow('fleet', 'sched.echo', Schedule(every=dt.timedelta(seconds=1),"
        " catch_up='all', overlap='allow', input={'fleet': True}))\n",
    )
    wait_for(lambda: fired(cluster, database) >= 6, timeout=TIMEOUT, message="first ticks")

    until_after_a_tick(cluster, database)
    fleet[0].proc.send_signal(signal.SIGKILL)
    fleet[0].proc.wait(timeout=30)
    at_kill = fired(cluster, database)
    wait_for(
        lambda: fired(cluster, database) >= at_kill + 8,
        timeout=TIMEOUT,
        message=lambda: f"ticks after the kill:\n{fleet[1].report()}",
    )

    until_after_a_tick(cluster, database)
    # A crash of the server, and three ticks' worth of downtime before it is back.
    cluster.stop("immediate")
    time.sleep(3)
    cluster.start()
    wait_for(
        lambda: all("database unavailable" in w.output() for w in fleet[1:]),
        timeout=TIMEOUT,
        message="both workers to notice the restart",
    )
    wait_for(
        lambda: fired(cluster, database) >= TICKS + 4,
        timeout=TIMEOUT,
        message=lambda: f"ticks after the restart:\n{fleet[1].report()}",
    )
    for worker in fleet[1:]:
        assert worker.proc.poll() is None, worker.report()
        worker.signal(signal.SIGTERM)
    for worker in fleet[1:]:
        assert worker.wait(timeout=TIMEOUT) == 0, worker.report()

    report = json.loads(
        django_script(
            url,
            "import json\n"
            "from k2b_workflows.models import WorkflowRun, WorkflowSchedule\n"
            "s = WorkflowSchedule.objects.get(schedule_id='fleet')\n"
            "runs = list(WorkflowRun.objects.filter(schedule_id='fleet'))\n"
            "print(json.dumps({'anchor': s.anchor.isoformat(), 'last': s.last_tick.isoformat(),\n"
            "  'ticks': [r.scheduled_for.isoformat() for r in runs],\n"
            "  'keys': [r.idempotency_key for r in runs],\n"
            "  'inputs_ok': all(r.input == {'fleet': True, 'scheduled_for':"
            " r.scheduled_for.isoformat()} for r in runs),\n"
            "  'lags': [(r.created_at - r.scheduled_for).total_seconds() for r in runs]}))\n",
        )
        .strip()
        .splitlines()[-1]
    )
    anchor = dt.datetime.fromisoformat(report["anchor"])
    last = dt.datetime.fromisoformat(report["last"])
    expected = {
        (anchor + dt.timedelta(seconds=n)).isoformat()
        for n in range(1, round((last - anchor).total_seconds()) + 1)
    }
    got = report["ticks"]
    duplicates = len(got) - len(set(got))
    print(
        f"schedule fleet: {len(expected)} ticks, {len(got)} runs, {duplicates} duplicates,"
        f" {len(expected - set(got))} lost, max lag {max(report['lags']):.2f} s"
    )
    assert len(expected) >= TICKS
    assert duplicates == 0
    assert set(got) == expected
    assert report["inputs_ok"]
    assert len(set(report["keys"])) == len(got)
