"""The admin's fork: "Fork from this step" on a run's page, and "fork from failure" over a
selection of failed runs (capped, behind a confirmation page)."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client
from django.urls import reverse

from k2b_workflows import start_workflow_run
from k2b_workflows.admin import views as admin_views
from k2b_workflows.models import LedgerEntry, WorkflowRun
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall
from tests.support.admin import client_for, make_user, messages_of, run_url
from tests.workflows import forks as wf

pytestmark = pytest.mark.django_db(transaction=True)

APPS = ["forks"]


@pytest.fixture(autouse=True)
def broken():
    wf.BROKEN["on"] = True
    yield wf.BROKEN
    wf.BROKEN["on"] = True


@pytest.fixture
def forker() -> Client:
    return client_for(make_user("fran", "view_workflowrun", "fork_workflowrun"))


def ended(input: dict) -> WorkflowRun:
    run = start_workflow_run("forks.line", input)
    run_until_idle(app_ids=APPS)
    run.refresh_from_db()
    return run


def fork_url(run: WorkflowRun, step: object) -> str:
    return f"{reverse('admin:k2b_workflows_workflowrun_fork', args=[run.pk])}?step={step}"


def test_the_run_page_offers_fork_from_each_step_with_the_permission(forker):
    run = ended({"to": "a@example.com"})
    html = forker.get(run_url(run)).content.decode()
    assert "Fork from a step…" in html
    assert f"{reverse('admin:k2b_workflows_workflowrun_fork', args=[run.pk])}?step=1" in html
    viewer = client_for(make_user("vic", "view_workflowrun"))
    assert "Fork from" not in viewer.get(run_url(run)).content.decode()
    assert viewer.get(fork_url(run, 1)).status_code == 403


def test_the_fork_page_lists_the_effects_it_would_repeat_first(forker):
    run = ended({"to": "a@example.com", "pay": True})
    page = forker.get(fork_url(run, 1))
    html = page.content.decode()
    assert html.index("Effects this fork would repeat") < html.index('id="k2b-fork-form"')
    assert "forks.pay" in html and "confirmed" in html
    assert [seq for seq, _ in page.context["form"].fields["repeat_effects"].choices] == [2, 1]
    assert not run.forks.exists()  # showing the page forks nothing


def test_a_fork_post_without_the_external_step_checked_is_refused_and_forks_nothing(forker):
    run = ended({"to": "a@example.com", "pay": True})
    page = forker.post(fork_url(run, 1), {"step": "1", "reason": "fixed"})
    assert page.status_code == 200
    assert "forks.pay" in str(page.context["form"].non_field_errors())
    assert not run.forks.exists()


def test_a_fork_post_with_the_step_checked_forks_and_records_who_and_why(forker, broken):
    run = ended({"to": "a@example.com", "pay": True})
    broken["on"] = False
    response = forker.post(
        fork_url(run, 1), {"step": "1", "reason": "refunded", "repeat_effects": ["2"]}
    )
    (forked,) = run.forks.all()
    assert response.url == run_url(forked)
    entry = LedgerEntry.objects.get(run=forked, kind="forked")
    assert (entry.actor, entry.message, entry.detail["repeat_effects"]) == ("fran", "refunded", [2])
    assert "Forked from step 1" in LogEntry.objects.get(object_id=str(run.pk)).get_change_message()
    run_until_idle(app_ids=APPS)
    forked.refresh_from_db()
    assert forked.status == "succeeded"
    assert ProviderCall.objects.filter(action="forks.pay").count() == 2


def test_a_fork_without_a_reason_is_a_form_error(forker):
    run = ended({"to": "a@example.com"})
    page = forker.post(fork_url(run, 2), {"step": "2", "reason": " "})
    assert "reason" in page.context["form"].errors
    assert not run.forks.exists()


def test_a_step_that_is_not_one_of_the_run_sends_back_to_its_page(forker):
    run = ended({"to": "a@example.com"})
    response = forker.get(fork_url(run, 9))
    assert response.url == run_url(run)
    assert any("not a step" in m for m in messages_of(forker.get(response.url)))


def test_fork_from_failure_over_a_selection_confirms_then_forks_only_the_safe_ones(forker, broken):
    safe = ended({"to": "a@example.com"})
    paid = ended({"to": "b@example.com", "pay": True, "behaviour": "decline"})
    url = reverse("admin:k2b_workflows_workflowrun_changelist")
    selected = [str(safe.pk), str(paid.pk)]
    page = forker.post(url, {"action": "fork_runs", "_selected_action": selected, "index": "0"})
    assert page.context["eligible"] == [safe]
    assert [r for r, _ in page.context["skipped"]] == [paid]
    assert not WorkflowRun.objects.filter(forked_from__isnull=False).exists()

    forker.post(
        url,
        {"action": "fork_runs", "_selected_action": selected, "post": "yes", "reason": "fixed"},
    )
    assert safe.forks.count() == 1 and not paid.forks.exists()


def test_fork_from_failure_has_a_hard_cap(forker, monkeypatch):
    runs = [ended({"to": f"{i}@example.com"}) for i in range(3)]
    monkeypatch.setattr(admin_views, "FORK_SELECTION_CAP", 2)
    url = reverse("admin:k2b_workflows_workflowrun_changelist")
    selected = [str(r.pk) for r in runs]
    response = forker.post(
        url,
        {"action": "fork_runs", "_selected_action": selected, "post": "yes", "reason": "fixed"},
        follow=True,
    )
    assert any("at most 2" in m for m in messages_of(response))
    assert not WorkflowRun.objects.filter(forked_from__isnull=False).exists()


def test_a_fork_and_its_original_link_to_each_other_on_their_pages(forker):
    from k2b_workflows import fork_workflow_run

    run = ended({"to": "a@example.com"})
    forked = fork_workflow_run(run.pk, from_step=2, actor="ops", reason="fixed")
    assert f'href="{run_url(run)}"' in forker.get(run_url(forked)).content.decode()
    assert f'href="{run_url(forked)}"' in forker.get(run_url(run)).content.decode()
