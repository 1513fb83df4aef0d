"""The Schedules page: add, edit, pause, resume and "run now", each with its permission and audit.

Through Django's test client, as tests/admin/test_admin.py does for runs.
"""

from __future__ import annotations

import datetime as dt

import pytest
from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.urls import reverse

from k2b_workflows import Schedule, schedule_workflow
from k2b_workflows.models import WorkflowRun, WorkflowSchedule, WorkflowScheduleSkip
from k2b_workflows.scheduling import run_schedule_now, sync_decorator_schedules
from tests.support.admin import client_for, make_user

pytestmark = pytest.mark.django_db(transaction=True)

VIEW_ADD_CHANGE = ("view_workflowschedule", "add_workflowschedule", "change_workflowschedule")


def add_url() -> str:
    return reverse("admin:k2b_workflows_workflowschedule_add")


def change_url(row: WorkflowSchedule) -> str:
    return reverse("admin:k2b_workflows_workflowschedule_change", args=[row.pk])


def form(**values: str) -> dict[str, str]:
    data = {
        "schedule_id": "nightly-report",
        "workflow_name": "sched.echo",
        "workflow_version": "",
        "cron": "0 3 * * *",
        "every": "",
        "timezone": "Europe/Berlin",
        "input": '{"kind": "daily"}',
        "catch_up": "latest",
        "overlap": "skip",
        "jitter": "",
    }
    data.update(values)
    return data


@pytest.fixture
def editor():
    return client_for(make_user("eda", *VIEW_ADD_CHANGE))


def test_an_operator_adds_a_schedule_and_the_addition_is_logged(editor):
    response = editor.post(add_url(), form())

    assert response.status_code == 302, response.content.decode()[:3000]
    row = WorkflowSchedule.objects.get(schedule_id="nightly-report")
    assert (row.source, row.cron, row.timezone, row.input) == (
        "admin",
        "0 3 * * *",
        "Europe/Berlin",
        {"kind": "daily"},
    )
    assert row.next_tick is not None and row.next_tick.astimezone(
        dt.timezone(dt.timedelta(hours=1))
    ).hour in (3, 4)
    assert LogEntry.objects.filter(object_id=str(row.pk), action_flag=ADDITION).exists()


@pytest.mark.parametrize(
    ("values", "field", "message"),
    [
        ({"cron": "0 25 * * *"}, "cron", "Bad hour"),
        ({"timezone": "Mars/Olympus"}, "timezone", "not a known time zone"),
        ({"cron": "", "every": ""}, "cron", "got neither"),
        ({"every": "01:00:00"}, "cron", "got both"),
        ({"cron": "", "every": "0.5"}, "every", "under one second"),
        ({"input": "{not json"}, "input", "JSON"),
        ({"input": "[1, 2]"}, "input", "JSON object"),
        ({"workflow_name": "sched.nope"}, "workflow_name", "no workflow named"),
        ({"workflow_version": "9"}, "workflow_version", "no version 9"),
    ],
)
def test_a_bad_spec_in_the_form_is_an_error_on_its_field(editor, values, field, message):
    response = editor.post(add_url(), form(**values))

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert field in errors, errors
    assert message in " ".join(errors[field]), errors
    assert not WorkflowSchedule.objects.exists()


def test_the_preview_shows_the_next_five_fire_times_or_the_error(editor):
    url = reverse("admin:k2b_workflows_workflowschedule_preview")

    ok = editor.get(url, {"cron": "30 2 * * *", "timezone": "Europe/Berlin"}).json()
    bad = editor.get(url, {"cron": "30 2 * * * * *"})
    every = editor.get(url, {"every": "90"}).json()

    assert len(ok["ticks"]) == 5
    assert all(dt.datetime.fromisoformat(t).minute in (0, 30) for t in ok["utc"])
    assert bad.status_code == 400 and bad.json()["field"] == "cron"
    gaps = {
        dt.datetime.fromisoformat(b) - dt.datetime.fromisoformat(a)
        for a, b in zip(every["utc"], every["utc"][1:], strict=False)
    }
    assert gaps == {dt.timedelta(seconds=90)}


def test_the_schedule_page_shows_next_fire_times_runs_and_skips(editor):
    row = schedule_workflow("page", "sched.echo", Schedule(every=dt.timedelta(hours=1)))
    run = run_schedule_now(row)
    WorkflowScheduleSkip.objects.create(
        schedule=row, first_tick=row.anchor, last_tick=row.anchor, count=3, reason="overlap"
    )
    page = editor.get(change_url(row)).content.decode()

    preview = page[page.index('id="k2b-schedule-preview"') :]
    assert preview[: preview.index("</ul>")].count("<li>") == 5
    assert str(run.pk) in page
    assert "previous run not ended (overlap)" in page
    assert "Pause" not in page  # the editor may not pause


def test_pause_resume_and_run_now_need_their_own_permissions(editor):
    row = schedule_workflow("guarded", "sched.echo", Schedule(every=dt.timedelta(hours=1)))
    for name in ("pause", "resume", "run_now"):
        url = reverse(f"admin:k2b_workflows_workflowschedule_{name}", args=[row.pk])
        assert editor.post(url).status_code == 403, name
    row.refresh_from_db()
    assert not row.paused
    assert not WorkflowRun.objects.filter(schedule_id="guarded").exists()


def test_pause_resume_and_run_now_are_logged_with_the_operator():
    operator = make_user("pat", *VIEW_ADD_CHANGE, "pause_workflowschedule", "run_workflowschedule")
    client = client_for(operator)
    row = schedule_workflow("audited", "sched.echo", Schedule(every=dt.timedelta(hours=1)))

    client.post(reverse("admin:k2b_workflows_workflowschedule_pause", args=[row.pk]))
    row.refresh_from_db()
    assert row.paused
    client.post(reverse("admin:k2b_workflows_workflowschedule_resume", args=[row.pk]))
    client.post(reverse("admin:k2b_workflows_workflowschedule_run_now", args=[row.pk]))
    row.refresh_from_db()

    assert not row.paused and row.resumed_at is not None
    (run,) = WorkflowRun.objects.filter(schedule_id="audited")
    messages = list(
        LogEntry.objects.filter(object_id=str(row.pk), action_flag=CHANGE, user=operator)
        .order_by("id")
        .values_list("change_message", flat=True)
    )
    assert messages == ["Paused", "Resumed", f"Ran now: run {run.pk}"]


def test_the_bulk_actions_need_the_permissions_too(editor):
    row = schedule_workflow("bulk", "sched.echo", Schedule(every=dt.timedelta(hours=1)))
    changelist = reverse("admin:k2b_workflows_workflowschedule_changelist")
    response = editor.post(
        changelist, {"action": "pause_schedules", "_selected_action": [row.pk]}, follow=True
    )

    row.refresh_from_db()
    assert not row.paused
    assert response.status_code == 200


def test_a_decorator_schedule_is_read_only_in_the_admin_but_for_pausing(editor):
    from k2b_workflows import workflow, workflows

    saved = {name: dict(v) for name, v in workflows._registry.items()}
    try:
        workflow("sched.in_code", app_id="sched", schedule=Schedule("0 4 * * *"))(
            lambda run, input: {}
        )
        sync_decorator_schedules()
        row = WorkflowSchedule.objects.get(schedule_id="sched.in_code")
        page = editor.get(change_url(row)).content.decode()
    finally:
        workflows._registry.clear()
        workflows._registry.update(saved)

    assert 'name="cron"' not in page
    assert "0 4 * * *" in page
