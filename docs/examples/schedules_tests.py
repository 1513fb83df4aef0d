"""docs/schedules.md, "Testing a schedule": the controlled clock fires the ticks."""

import datetime as dt
from zoneinfo import ZoneInfo

from k2b_workflows.models import WorkflowRun, WorkflowSchedule
from k2b_workflows.testing import controlled_clock, run_until_idle

from .schedules import schedule_tenant_digest


# --8<-- [start:test]
def test_the_digest_goes_out_every_hour_and_catches_up_after_downtime():
    with controlled_clock() as clock:
        schedule = schedule_tenant_digest(42)
        clock.advance(hours=1)
        run_until_idle()  # fires the due tick, then runs its run
        assert WorkflowRun.objects.filter(schedule_id="tenant-42-digest").count() == 1

        clock.advance(hours=5)  # the fleet was down for five hours
        run_until_idle()

        runs = WorkflowRun.objects.filter(schedule_id="tenant-42-digest")
        assert runs.filter(status="succeeded").count() == 6
        ticks = sorted(runs.values_list("scheduled_for", flat=True))
        assert ticks == [schedule.anchor + dt.timedelta(hours=h) for h in range(1, 7)]


# --8<-- [end:test]


# --8<-- [start:decorator_test]
def test_the_nightly_report_runs_at_three_in_berlin():
    nightly = WorkflowSchedule.objects.get(schedule_id="reports.nightly")
    tick, fires = nightly.next_tick, nightly.next_fire_at  # set while the schedule is active
    assert tick and fires and tick.astimezone(ZoneInfo("Europe/Berlin")).hour == 3
    with controlled_clock() as clock:
        clock.advance_to(fires)
        run_until_idle()
    (run,) = WorkflowRun.objects.filter(schedule_id="reports.nightly")
    assert run.status == "succeeded"
    assert run.input == {"kind": "daily", "scheduled_for": tick.isoformat()}


# --8<-- [end:decorator_test]
