"""Operating schedules: ``workflowschedules``, late schedules in ``workflowstatus``, the
database checks, and the metrics (lag, ticks skipped by overlap)."""

from __future__ import annotations

import datetime as dt
import io
import json

import pytest
from django.core import checks
from django.core.management import call_command
from prometheus_client import REGISTRY

from k2b_workflows import Schedule, schedule_workflow
from k2b_workflows.kernel import schedule_seals
from k2b_workflows.models import WorkflowSchedule
from k2b_workflows.testing import run_until_idle
from tests.support.processes import workflowstatus
from tests.workflows.schedules import release

pytest_plugins = ["k2b_workflows.pytest_plugin"]
pytestmark = pytest.mark.django_db(transaction=True)


def listing(*args: str) -> str:
    out = io.StringIO()
    call_command("workflowschedules", *args, stdout=out)
    return out.getvalue()


def test_workflowschedules_lists_each_schedule_with_its_next_ticks():
    hourly = schedule_workflow("hourly", "sched.echo", Schedule(every=dt.timedelta(hours=1)))
    paused = schedule_workflow("paused", "sched.echo", Schedule("0 3 * * *", timezone="Asia/Tokyo"))
    paused.paused = True
    paused.save()

    (first, second) = json.loads(listing("--json", "--next", "4"))
    text = listing()

    assert (first["schedule_id"], first["state"], second["state"]) == ("hourly", "active", "paused")
    assert first["next_ticks"] == [
        (hourly.next_tick + n * dt.timedelta(hours=1)).isoformat() for n in range(4)
    ]
    assert "cron 0 3 * * * (Asia/Tokyo)" in text and "every 1:00:00" in text


def test_workflowstatus_reports_a_late_schedule_and_exits_1(k2b_clock):
    schedule_workflow("nobody-fires-me", "sched.echo", Schedule(every=dt.timedelta(minutes=1)))
    assert workflowstatus()[0] == 0

    k2b_clock.advance(minutes=3)  # due two minutes ago, and no worker ran a pass
    code, _out, err = workflowstatus()
    report = json.loads(workflowstatus("--json")[1])

    assert code == 1
    assert "LATE SCHEDULE nobody-fires-me" in err
    assert [s["schedule_id"] for s in report["late_schedules"]] == ["nobody-fires-me"]
    assert "LATE" in listing()
    assert "k2b_schedules_late 1.0" in scrape()
    run_until_idle(timeout=30)
    assert workflowstatus()[0] == 0
    assert "k2b_schedules_late 0.0" in scrape()


def scrape() -> str:
    from django.test import RequestFactory

    from k2b_workflows import metrics

    return metrics.metrics_view(RequestFactory().get("/metrics")).content.decode()


def database_warnings() -> list[checks.CheckMessage]:
    return [
        m
        for m in checks.run_checks(databases=["default"], tags=[checks.Tags.database])
        if m.id in ("k2b_workflows.W030", "k2b_workflows.W031", "k2b_workflows.W032")
    ]


def test_the_database_check_names_schedules_that_cannot_fire():
    schedule_workflow("good", "sched.echo", Schedule("0 3 * * *"))
    schedule_workflow("gone", "sched.echo", Schedule("0 3 * * *"))
    schedule_workflow("pinned", "sched.echo", Schedule("0 3 * * *"))
    WorkflowSchedule.objects.filter(schedule_id="gone").update(workflow_name="sched.removed")
    WorkflowSchedule.objects.filter(schedule_id="pinned").update(workflow_version=3)
    WorkflowSchedule.objects.filter(schedule_id="good").update(timezone="Europe/Nowhere")
    for row in WorkflowSchedule.objects.all():  # by a key holder: a dump of another release
        WorkflowSchedule.objects.filter(pk=row.pk).update(
            seal=schedule_seals.seal(row.sealed_values())
        )
    WorkflowSchedule.objects.create(
        schedule_id="old.decorated",
        workflow_name="sched.echo",
        cron="0 3 * * *",
        source="decorator",
    )

    found = {(m.id, m.msg.split(":")[0], m.msg.split(":")[1].strip()) for m in database_warnings()}

    assert found == {
        ("k2b_workflows.W030", "schedule 'good'", "timezone"),
        ("k2b_workflows.W031", "schedule 'gone'", "workflow"),
        ("k2b_workflows.W031", "schedule 'pinned'", "workflow"),
        (
            "k2b_workflows.W032",
            "schedule 'old.decorated'",
            "the @workflow decorator no longer declares it",
        ),
    }


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_the_metrics_count_ticks_skipped_by_overlap_and_the_lag(k2b_clock):
    skipped = sample("k2b_schedule_ticks_skipped_total", reason="overlap")
    lags = sample("k2b_schedule_lag_seconds_count")
    schedule = schedule_workflow("metered", "sched.waits", Schedule(every=dt.timedelta(minutes=1)))
    for _ in range(3):
        k2b_clock.advance(minutes=1)
        run_until_idle(timeout=30)

    assert sample("k2b_schedule_ticks_skipped_total", reason="overlap") == skipped + 2
    assert sample("k2b_schedule_lag_seconds_count") == lags + 1
    release((schedule.anchor + dt.timedelta(minutes=1)).isoformat())
    run_until_idle(timeout=30)
