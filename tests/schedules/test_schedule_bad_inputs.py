"""Schedule bad inputs the second review found (#35): each a clear error naming the argument.

Before: the admin answered HTTP 500 to an ``every`` or ``jitter`` of 999,999,999
days (and its preview too), ``schedule_workflow`` raised OverflowError from its
save, a jitter longer than the interval and a zone with ``every`` were silently
kept, and ``*/99999999999999999999`` was a valid cron step.
"""

from __future__ import annotations

import datetime as dt

import pytest
from django.urls import reverse

from k2b_workflows import InvalidSchedule, Schedule, schedule_workflow
from k2b_workflows.models import WorkflowSchedule
from tests.schedules.test_admin_schedules import add_url, editor, form  # noqa: F401  (the fixture)

pytestmark = pytest.mark.django_db

HUGE = dt.timedelta(days=999_999_999)


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ({"every": HUGE}, "every", "longer than 3660 days"),
        ({"every": dt.timedelta(hours=1), "jitter": HUGE}, "jitter", "longer than 3660 days"),
        ({"every": dt.timedelta(hours=1), "jitter": dt.timedelta(hours=2)}, "jitter", "shorter"),
        ({"every": dt.timedelta(hours=1), "jitter": dt.timedelta(hours=1)}, "jitter", "shorter"),
        ({"every": dt.timedelta(hours=1), "timezone": "Europe/Berlin"}, "timezone", "cron"),
        ({"cron": "*/99999999999999999999 * * * *"}, "cron", "minute step"),
        ({"cron": "0 */25 * * *"}, "cron", "hour step"),
        ({"cron": "*/61 * * * * *"}, "cron", "second step"),
    ],
)
def test_schedule_workflow_refuses_it_naming_the_argument(spec, field, message):
    with pytest.raises(InvalidSchedule, match=message) as caught:
        schedule_workflow("bad", "sched.echo", Schedule(spec.pop("cron", None), **spec))
    assert caught.value.field == field
    assert not WorkflowSchedule.objects.exists()


def test_the_longest_spans_and_steps_still_work():
    longest = Schedule(every=dt.timedelta(days=3660), jitter=dt.timedelta(days=3659))
    schedule_workflow("long", "sched.echo", longest)
    schedule_workflow("steps", "sched.echo", Schedule("*/59 */23 */31 */12 */7"))
    assert WorkflowSchedule.objects.count() == 2


@pytest.mark.parametrize(
    ("values", "field", "message"),
    [
        ({"cron": "", "every": "999999999 00:00:00", "timezone": "UTC"}, "every", "3660 days"),
        ({"jitter": "999999999 00:00:00"}, "jitter", "3660 days"),
        ({"cron": "", "every": "01:00:00", "timezone": "UTC", "jitter": "02:00:00"}, "jitter", ""),
        ({"cron": "", "every": "01:00:00"}, "timezone", "cron"),
        ({"cron": "*/99999999999999999999 * * * *"}, "cron", "minute step"),
    ],
)
def test_the_admin_form_shows_it_on_the_field(editor, values, field, message):  # noqa: F811
    response = editor.post(add_url(), form(**values))

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert field in errors, errors
    assert message in " ".join(errors[field]), errors
    assert not WorkflowSchedule.objects.exists()


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"every": str(999_999_999 * 86400)}, "every"),
        ({"cron": "*/99999999999999999999 * * * *"}, "cron"),
    ],
)
def test_the_preview_answers_400_naming_the_field(editor, query, field):  # noqa: F811
    response = editor.get(reverse("admin:k2b_workflows_workflowschedule_preview"), query)
    assert response.status_code == 400, response.content[:500]
    assert response.json()["field"] == field
