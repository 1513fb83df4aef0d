"""The Queues page and ``manage.py workflowqueues``: counts, pauses, who may change them (#49)."""

from __future__ import annotations

import io
import json

import pytest
from django.contrib.admin.models import LogEntry
from django.core.management import CommandError, call_command
from django.urls import reverse

from k2b_workflows import pause_queue, paused_queues, start_workflow_run
from k2b_workflows import queues as queue_reads
from k2b_workflows.testing import run_until_idle
from tests.support.admin import client_for, make_user, messages_of

pytestmark = pytest.mark.django_db(transaction=True)

PAGE = "admin:k2b_workflows_queuepause_changelist"
PAUSE = "admin:k2b_workflows_queuepause_pause"
RESUME = "admin:k2b_workflows_queuepause_resume"


@pytest.fixture
def two_queues() -> None:
    """ "default": one run succeeded; "held": paused, with two runs waiting."""
    start_workflow_run("queues.note", {"n": 1})
    run_until_idle(timeout=30)
    pause_queue("held", reason="provider outage", actor="deploy-bot")
    for n in (2, 3):
        start_workflow_run("queues.held", {"n": n})


def row_of(html: str, queue: str) -> str:
    return html.split(f'data-queue="{queue}"', 1)[1].split("</tr>", 1)[0]


def test_the_page_shows_each_queue_with_its_counts_and_who_paused_it_and_why(two_queues):
    viewer = make_user("viewer", "view_workflowrun")
    page = client_for(viewer).get(reverse(PAGE))
    assert page.status_code == 200
    html = page.content.decode()
    held, default = row_of(html, "held"), row_of(html, "default")
    assert "paused" in held and "deploy-bot" in held and "provider outage" in held
    assert '<td class="k2b-num">2</td>' in held  # queued
    assert "active" in default and '<td class="k2b-num">1</td>' in default  # succeeded
    # Seeing is not changing: no buttons without the permission, and no script at all.
    content = html.split('id="content-main"', 1)[1]
    assert "<form" not in content.split("</table>", 1)[0] and "<script" not in content


def test_pause_and_resume_buttons_work_with_the_permission_and_enter_the_history(two_queues):
    operator = make_user("olga", "view_workflowrun", "pause_queue")
    client = client_for(operator)
    html = client.get(reverse(PAGE)).content.decode()
    assert 'value="Resume"' in row_of(html, "held") and 'value="Pause"' in row_of(html, "default")
    answer = client.post(reverse(PAUSE), {"queue": "default", "reason": "slow database"})
    assert answer.status_code == 302
    assert paused_queues()["default"].paused_by == "olga"
    assert client.post(reverse(RESUME), {"queue": "held"}).status_code == 302
    assert set(paused_queues()) == {"default"}
    history = LogEntry.objects.filter(user=operator).order_by("pk")
    assert [(e.object_id, e.change_message) for e in history] == [
        ("default", "Paused: slow database"),
        ("held", "Resumed"),
    ]


def test_a_pause_from_the_page_without_a_reason_changes_nothing_and_says_why(two_queues):
    client = client_for(make_user("olga", "view_workflowrun", "pause_queue"))
    answer = client.post(reverse(PAUSE), {"queue": "default", "reason": " "}, follow=True)
    assert "pausing queue 'default' needs a reason" in messages_of(answer)[0]
    assert set(paused_queues()) == {"held"}


def test_without_the_permission_pause_and_resume_are_refused(two_queues):
    client = client_for(make_user("viewer", "view_workflowrun"))
    assert client.post(reverse(PAUSE), {"queue": "default", "reason": "x"}).status_code == 403
    assert client.post(reverse(RESUME), {"queue": "held"}).status_code == 403
    assert set(paused_queues()) == {"held"}
    assert not LogEntry.objects.exists()


def test_the_page_needs_the_view_permission(two_queues):
    client = client_for(make_user("nobody"))
    assert client.get(reverse(PAGE)).status_code == 403


def test_a_pause_through_the_page_is_protected_by_csrf(two_queues):
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    client.force_login(make_user("olga", "view_workflowrun", "pause_queue"))
    assert client.post(reverse(PAUSE), {"queue": "default", "reason": "x"}).status_code == 403
    assert set(paused_queues()) == {"held"}


def test_counts_are_capped_and_shown_so(two_queues, monkeypatch):
    monkeypatch.setattr(queue_reads, "COUNT_CAP", 2)
    (held,) = [v for v in queue_reads.read() if v.name == "held"]
    assert held.counts["queued"] == 2 and dict(held.shown_counts())["queued"] == "2+"


# -- manage.py workflowqueues ----------------------------------------------------------------


def command(*args: str) -> str:
    out = io.StringIO()
    call_command("workflowqueues", *args, stdout=out)
    return out.getvalue()


def test_the_command_lists_pauses_and_resumes(two_queues):
    listing = command("list")
    assert "held" in listing and "PAUSED" in listing and "provider outage" in listing
    assert "pause default: paused" not in listing
    assert command("pause", "default", "--reason", "slow database") == "queue default paused\n"
    assert "was paused already" in command("pause", "default", "--reason", "again")
    assert paused_queues()["default"].reason == "slow database"
    assert command("resume", "default") == "queue default resumed\n"
    assert command("resume", "default") == "queue default was not paused: nothing to do\n"
    (held,) = [q for q in json.loads(command("list", "--json")) if q["queue"] == "held"]
    assert held["counts"]["queued"] == 2 and held["paused"]["paused_by"] == "deploy-bot"


def test_the_command_acts_for_a_named_user_who_needs_the_permission(two_queues):
    make_user("viewer", "view_workflowrun")
    with pytest.raises(CommandError, match=r"k2b_workflows\.pause_queue"):
        command("pause", "default", "--reason", "x", "--actor", "viewer")
    with pytest.raises(CommandError, match="no user 'ghost'"):
        command("resume", "held", "--actor", "ghost")
    operator = make_user("olga", "pause_queue")
    command("resume", "held", "--actor", "olga")
    assert LogEntry.objects.get(user=operator).change_message == "Resumed"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("pause", "default"), "--reason"),
        (("pause", "", "--reason", "x"), "1 to 100 characters"),
        (("pause", "q" * 101, "--reason", "x"), "1 to 100 characters"),
        (("pause", "   ", "--reason", "x"), "queue must not be empty"),
        (("pause", "default", "--reason", " "), "needs a reason"),
    ],
)
def test_the_command_refuses_bad_input_naming_it(args, message):
    with pytest.raises(CommandError, match=message):
        command(*args)
    assert paused_queues() == {}
