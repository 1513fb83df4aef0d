"""Schedules fired by real ``runworkflows`` processes: catch-up after downtime and after a
pause, and overlap with a workflow slower than its ticks.

The ticks are one second apart and real: every wait is on a condition of the
database (a tick fired, a run ended), never a fixed sleep standing for one.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import signal

import pytest
from django.db import connection

from k2b_workflows import Schedule, schedule_workflow
from k2b_workflows.models import WorkflowRun, WorkflowSchedule, WorkflowScheduleSkip
from tests.support.processes import wait_for

pytestmark = [pytest.mark.slow]

SECOND = dt.timedelta(seconds=1)
TIMEOUT = 120
#: A tick seen two seconds late is missed (the default minute would make the test slow).
SETTINGS = {"K2B_TEST_SETTINGS": json.dumps({"SCHEDULE_MISSED_AFTER_MS": 2000})}


def db_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT k2b_now()")
        return cursor.fetchone()[0]


def ticks(schedule_id: str) -> list[dt.datetime]:
    return sorted(
        WorkflowRun.objects.filter(schedule_id=schedule_id).values_list("scheduled_for", flat=True)
    )


def row(schedule_id: str) -> WorkflowSchedule:
    return WorkflowSchedule.objects.get(schedule_id=schedule_id)


def grid(first: dt.datetime, last: dt.datetime) -> list[dt.datetime]:
    """Every one-second tick from ``first`` to ``last``."""
    return [first + n * SECOND for n in range(round((last - first) / SECOND) + 1)]


def stop(worker) -> None:
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=TIMEOUT) == 0, worker.report()


def fired_up_to(schedule_ids: list[str], moment: dt.datetime) -> bool:
    return all((last := row(s).last_tick) is not None and last >= moment for s in schedule_ids)


POLICIES = ("skip", "latest", "all")


def test_after_downtime_skip_and_latest_drop_the_missed_ticks_and_all_runs_every_one(
    start_worker,
):
    for policy in POLICIES:
        schedule_workflow(
            f"down-{policy}",
            "sched.echo",
            Schedule(every=SECOND, catch_up=policy, overlap="allow"),
        )
    created = max(row(f"down-{p}").anchor for p in POLICIES)
    # No worker is running: the fleet is down for five ticks or more.
    wait_for(lambda: db_now() > created + 6 * SECOND, timeout=TIMEOUT, message="downtime")
    worker = start_worker("--concurrency", "2", env=SETTINGS)
    ids = [f"down-{p}" for p in POLICIES]
    # However long the worker takes to start: three ticks after its first pass.
    wait_for(
        lambda: WorkflowRun.objects.filter(schedule_id="down-skip").exists(),
        timeout=TIMEOUT,
        message=lambda: f"the first pass after the downtime\n{worker.report()}",
    )
    back = db_now()
    wait_for(
        lambda: fired_up_to(ids, back + 3 * SECOND),
        timeout=TIMEOUT,
        message=lambda: f"ticks after the restart\n{worker.report()}",
    )
    stop(worker)

    for policy in POLICIES:
        schedule = row(f"down-{policy}")
        fired = ticks(schedule.schedule_id)
        assert len(fired) == len(set(fired)), policy
        if policy == "all":
            assert fired == grid(schedule.anchor + SECOND, schedule.last_tick)
            assert not WorkflowScheduleSkip.objects.filter(schedule=schedule).exists()
            continue
        missed = WorkflowScheduleSkip.objects.filter(schedule=schedule).order_by("id").first()
        assert missed is not None and missed.reason == "catch_up", policy
        assert missed.first_tick == schedule.anchor + SECOND
        assert missed.count >= 4, (policy, missed.count)
        # Nothing of the downtime ran but (latest) its last tick; from then on every tick did.
        assert fired == grid(missed.last_tick + SECOND, schedule.last_tick), policy
        first, second = WorkflowRun.objects.filter(schedule_id=schedule.schedule_id).order_by(
            "scheduled_for"
        )[:2]
        if policy == "latest":
            # The latest missed tick and the current one: started by the same pass.
            assert second.created_at - first.created_at < dt.timedelta(milliseconds=500)
        else:
            # The first run is the tick that was current: its successor was not due yet.
            assert first.created_at - first.scheduled_for < SECOND + dt.timedelta(milliseconds=100)


def test_on_resume_skip_starts_no_paused_tick_latest_one_and_all_every_one(start_worker):
    worker = start_worker("--concurrency", "2", env=SETTINGS)
    for policy in POLICIES:
        WorkflowSchedule(
            schedule_id=f"pause-{policy}",
            workflow_name="sched.echo",
            every=SECOND,
            catch_up=policy,
            overlap="allow",
            paused=True,
        ).save()
    created = max(row(f"pause-{p}").anchor for p in POLICIES)
    wait_for(lambda: db_now() > created + 5 * SECOND, timeout=TIMEOUT, message="a paused while")
    assert not WorkflowRun.objects.filter(schedule_id__startswith="pause-").exists()
    for policy in POLICIES:
        resumed = row(f"pause-{policy}")
        resumed.paused = False
        resumed.save()
    ids = [f"pause-{p}" for p in POLICIES]
    last_resume = max(row(s).resumed_at for s in ids)
    wait_for(
        lambda: fired_up_to(ids, last_resume + 3 * SECOND),
        timeout=TIMEOUT,
        message=lambda: f"ticks after the resume\n{worker.report()}",
    )
    stop(worker)

    for policy in POLICIES:
        schedule = row(f"pause-{policy}")
        fired = ticks(schedule.schedule_id)
        while_paused = [t for t in fired if t <= schedule.resumed_at]
        every_tick = grid(schedule.anchor + SECOND, schedule.last_tick)
        paused_grid = [t for t in every_tick if t <= schedule.resumed_at]
        expected = {"skip": [], "latest": paused_grid[-1:], "all": paused_grid}[policy]
        assert while_paused == expected, policy
        assert len(fired) == len(set(fired))
        after = [t for t in fired if t > schedule.resumed_at]
        assert after == [t for t in every_tick if t > schedule.resumed_at], policy


def _runs(schedule_id: str) -> list[WorkflowRun]:
    return list(WorkflowRun.objects.filter(schedule_id=schedule_id).order_by("scheduled_for"))


def _finished(schedule_id: str, n: int) -> bool:
    return WorkflowRun.objects.filter(schedule_id=schedule_id, status="succeeded").count() >= n


@pytest.mark.parametrize("overlap", ["skip", "buffer_one"])
def test_a_slow_workflow_never_overlaps_itself(start_worker, overlap):
    """Runs of 2.5 s on a one-second schedule: no run starts before the previous one ended."""
    worker = start_worker("--concurrency", "3")
    schedule_workflow(
        f"slow-{overlap}",
        "sched.slow",
        Schedule(every=SECOND, overlap=overlap, input={"nap": 2.5}),
    )
    buffered: set[dt.datetime] = set()

    def three_finished() -> bool:
        # What a skip never holds, sampled at every poll: a tick kept for later.
        if (tick := row(f"slow-{overlap}").buffered_tick) is not None:
            buffered.add(tick)
        return _finished(f"slow-{overlap}", 3)

    wait_for(three_finished, timeout=TIMEOUT, message=lambda: f"three slow runs\n{worker.report()}")
    stop(worker)

    runs = [r for r in _runs(f"slow-{overlap}") if r.status == "succeeded"]
    for earlier, later in itertools.pairwise(runs):
        assert later.created_at >= earlier.finished_at, (earlier.scheduled_for, later.scheduled_for)
    reasons = set(
        WorkflowScheduleSkip.objects.filter(schedule__schedule_id=f"slow-{overlap}").values_list(
            "reason", flat=True
        )
    )
    # A pass that comes late on a loaded machine also records the ticks it found
    # superseded (catch_up); the ticks that met a running run are the overlap's.
    if overlap == "skip":
        assert "overlap" in reasons and reasons <= {"overlap", "catch_up"}
        # No tick was kept for later. (Not "each run queued within 2 s of its tick": a
        # pass that comes late on a loaded machine queues a tick that met no running
        # run by then, seconds after it.)
        assert buffered == set()
    else:
        assert "buffer_full" in reasons and reasons <= {"buffer_full", "catch_up"}
        assert buffered  # the check above can see a kept tick
        # After the first, each run is the buffered tick, started when the previous ended.
        assert all(r.created_at - r.scheduled_for > SECOND for r in runs[1:])
        for earlier, later in itertools.pairwise(runs):
            assert later.scheduled_for < earlier.finished_at
