"""The operators' actions on task calls in a real browser: headless Chromium (#49).

The runs list's "select all N" across pages is script (Django's actions.js):
an operator filters the list to one task, selects every call the filter
finds, cancels them after a confirmation page naming the count; re-enqueues
a selection; retries a failed call from its page; follows a Failures-page
count to the calls it counts; meets the cap; pauses and resumes a queue. Each
test reads what the click did in the database, not only the page.
"""

from __future__ import annotations

import re

import pytest
from django.contrib import admin
from django.contrib.auth.models import User
from django.urls import reverse

from k2b_workflows.admin import views as admin_views
from k2b_workflows.models import QueuePause, WorkflowRun
from k2b_workflows.testing import run_until_idle
from tests.support.browser import click_and_wait, signed_in
from tests.tasks_app import tasks as t

try:
    from django.tasks import TaskResultStatus
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskResultStatus  # type: ignore[no-redef]

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

RUNS = "admin:k2b_workflows_workflowrun_changelist"
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@pytest.fixture
def operator(browser, live_server) -> User:
    """An operator who may cancel, retry and pause, logged in."""
    return signed_in(
        browser,
        live_server,
        "ravi",
        "night-shift-2024",
        ["view_workflowrun", "cancel_workflowrun", "retry_workflowrun", "pause_queue"],
    )


@pytest.fixture
def small_pages(monkeypatch) -> int:
    """The runs list shows 3 rows a page: a handful of calls spans pages."""
    monkeypatch.setattr(admin.site._registry[WorkflowRun], "list_per_page", 3)
    return 3


def wait_for(browser, condition, timeout: float = 10):
    from selenium.webdriver.support.wait import WebDriverWait

    return WebDriverWait(browser, timeout).until(condition)


def filter_by_task(browser, live_server, task) -> None:
    """Open the runs list and click the task filter's choice for ``task``."""
    from selenium.webdriver.common.by import By

    browser.get(live_server.url + reverse(RUNS))
    click_and_wait(browser, browser.find_element(By.LINK_TEXT, task.module_path))
    assert f"task={task.module_path}" in browser.current_url


def listed_ids(browser) -> list[str]:
    from selenium.webdriver.common.by import By

    links = browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr .field-short_id a")
    return [UUID.search(a.get_attribute("href")).group(0) for a in links]


def select_all_across_pages(browser, total: int) -> None:
    """Tick the header box, then actions.js's "Select all N" link; wait for its notes."""
    from selenium.webdriver.common.by import By

    browser.find_element(By.ID, "action-toggle").click()
    question = browser.find_element(By.CSS_SELECTOR, ".actions .question")
    wait_for(browser, lambda _: question.is_displayed())
    link = question.find_element(By.TAG_NAME, "a")
    assert f"Select all {total} " in link.text
    link.click()
    everything = browser.find_element(By.CSS_SELECTOR, ".actions .all")
    wait_for(browser, lambda _: everything.is_displayed())
    assert f"All {total} " in everything.text
    assert browser.find_element(By.NAME, "select_across").get_attribute("value") == "1"


def run_action(browser, action: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.select import Select

    Select(browser.find_element(By.NAME, "action")).select_by_value(action)
    click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, ".actions button[name=index]"))


def confirm(browser, reason: str, button: str) -> None:
    from selenium.webdriver.common.by import By

    browser.find_element(By.NAME, "reason").send_keys(reason)
    click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, f"input[value='{button}']"))


def messages(browser) -> str:
    from selenium.webdriver.common.by import By

    return browser.find_element(By.CSS_SELECTOR, ".messagelist").text


def test_select_all_across_pages_of_a_task_filter_cancels_every_call_it_finds(
    browser, live_server, operator, small_pages
):
    from selenium.webdriver.common.by import By

    chosen = [t.add.enqueue(i, 1) for i in range(7)]
    others = [t.noop.enqueue() for _ in range(2)]
    filter_by_task(browser, live_server, t.add)
    assert len(listed_ids(browser)) == small_pages, "the selection spans pages"
    assert set(listed_ids(browser)) < {r.id for r in chosen}

    select_all_across_pages(browser, len(chosen))
    run_action(browser, "cancel_calls")
    assert browser.find_element(By.TAG_NAME, "h1").text == "Cancel task calls"
    heading = browser.find_element(By.CSS_SELECTOR, "#content-main h2").text
    assert heading == "Cancel these 7 runs:"
    shown = {
        UUID.search(a.get_attribute("href")).group(0)
        for a in browser.find_elements(By.CSS_SELECTOR, ".k2b-run-list li a")
    }
    assert shown == {r.id for r in chosen}
    assert set(WorkflowRun.objects.values_list("status", flat=True)) == {"queued"}, (
        "the confirmation page changes nothing"
    )

    confirm(browser, "wrong amounts, re-sent tomorrow", "Yes, cancel")
    assert "Cancel: 7 run(s)." in messages(browser)
    for result in chosen:
        now = t.add.get_result(result.id)
        assert now.status == TaskResultStatus.FAILED
        assert now.errors[-1].exception_class_path.endswith("RunCanceled")
        assert WorkflowRun.objects.get(pk=result.id).status == "canceled"
    for result in others:
        assert t.noop.get_result(result.id).status == TaskResultStatus.READY
    run_until_idle()
    assert {t.add.get_result(r.id).status for r in chosen} == {TaskResultStatus.FAILED}
    assert {t.noop.get_result(r.id).status for r in others} == {TaskResultStatus.SUCCESSFUL}


def test_a_selection_is_re_enqueued_as_new_calls_with_the_same_arguments(
    browser, live_server, operator
):
    from selenium.webdriver.common.by import By

    failed = [t.boom.enqueue(f"no stock {i}") for i in range(3)]
    t.add.enqueue(1, 2)
    run_until_idle()
    picked = failed[:2]
    filter_by_task(browser, live_server, t.boom)
    for result in picked:
        row = browser.find_element(By.XPATH, f"//tr[.//a[contains(@href, '{result.id}')]]")
        row.find_element(By.CSS_SELECTOR, "input.action-select").click()
    counter = browser.find_element(By.CSS_SELECTOR, ".actions .action-counter")
    wait_for(browser, lambda _: counter.text.startswith("2 of 3 selected"))

    before = WorkflowRun.objects.count()
    run_action(browser, "reenqueue_runs")
    assert browser.find_element(By.CSS_SELECTOR, "#content-main h2").text == (
        "Re-enqueue these 2 runs:"
    )
    assert WorkflowRun.objects.count() == before, "the confirmation page starts nothing"
    confirm(browser, "stock is back", "Yes, re-enqueue")
    assert "Re-enqueue: 2 run(s)." in messages(browser)

    originals = WorkflowRun.objects.filter(pk__in=[r.id for r in picked])
    new = WorkflowRun.objects.exclude(pk__in=[r.id for r in failed]).filter(
        task_path=t.boom.module_path
    )
    assert sorted(str(r.input) for r in new) == sorted(str(r.input) for r in originals)
    assert {r.status for r in new} == {"queued"}
    assert {r.status for r in originals} == {"failed"}, "the originals are not touched"
    assert WorkflowRun.objects.get(pk=failed[2].id).status == "failed"
    assert WorkflowRun.objects.count() == before + 2


def test_a_failed_call_is_retried_from_its_page_and_queued_again(browser, live_server, operator):
    from selenium.webdriver.common.by import By

    result = t.boom.enqueue("no stock")
    run_until_idle()
    assert t.boom.get_result(result.id).status == TaskResultStatus.FAILED
    filter_by_task(browser, live_server, t.boom)
    row = browser.find_element(By.XPATH, f"//tr[.//a[contains(@href, '{result.id}')]]")
    click_and_wait(browser, row.find_element(By.CSS_SELECTOR, ".field-short_id a"))
    retry = reverse("admin:k2b_workflows_workflowrun_retry", args=[result.id])
    button = browser.find_element(By.CSS_SELECTOR, f".object-tools a[href='{retry}']")
    assert button.text.lower() == "retry now…"
    click_and_wait(browser, button)
    assert "one more attempt of the same call" in browser.find_element(By.ID, "content-main").text
    assert WorkflowRun.objects.get(pk=result.id).status == "failed"

    confirm(browser, "stock is back", "Yes, retry now")
    assert "one more attempt of the same call" in messages(browser)
    assert WorkflowRun.objects.get(pk=result.id).status == "queued"
    # Queued for its next attempt, which Django's status calls RUNNING (``tasks.runs``).
    assert t.boom.get_result(result.id).status == TaskResultStatus.RUNNING
    run_until_idle()
    again = t.boom.get_result(result.id)
    assert (again.status, again.attempts) == (TaskResultStatus.FAILED, 2), "it ran once more"


def test_a_failures_count_links_to_the_calls_it_counts(browser, live_server, operator):
    from selenium.webdriver.common.by import By

    counted = [t.boom.enqueue(f"no stock {i}") for i in range(3)]
    other = t.external_boom.enqueue("provider down")
    t.add.enqueue(1, 2)
    run_until_idle()
    browser.get(live_server.url + reverse("admin:k2b_workflows_failures"))
    rows = browser.find_elements(By.CSS_SELECTOR, "#k2b-failure-table tbody tr")
    kinds = {r.find_element(By.TAG_NAME, "code").text: r for r in rows}
    assert set(kinds) == {"builtins.ValueError", "builtins.RuntimeError"}
    row = kinds["builtins.ValueError"]
    assert t.boom.module_path in row.text
    link = row.find_element(By.CSS_SELECTOR, "td.k2b-num a")
    assert link.text == "3"

    click_and_wait(browser, link)
    assert browser.find_element(By.TAG_NAME, "h1").text.startswith("Select")
    assert set(listed_ids(browser)) == {r.id for r in counted}
    assert other.id not in listed_ids(browser)


def test_a_selection_past_the_cap_is_refused_whole_with_its_count(
    browser, live_server, operator, small_pages, monkeypatch
):
    from selenium.webdriver.common.by import By

    monkeypatch.setattr(admin_views, "MAX_SELECTED", 4)
    calls = [t.add.enqueue(i, 1) for i in range(5)]
    filter_by_task(browser, live_server, t.add)
    select_all_across_pages(browser, 5)
    run_action(browser, "cancel_calls")
    said = messages(browser)
    assert "5 runs are selected" in said and "at most 4" in said and "Nothing was done" in said
    assert not browser.find_elements(By.NAME, "reason"), "no confirmation page"
    assert {t.add.get_result(r.id).status for r in calls} == {TaskResultStatus.READY}

    # Within the cap, the same action goes on to its confirmation page.
    browser.find_element(By.ID, "action-toggle").click()
    run_action(browser, "cancel_calls")
    assert browser.find_element(By.CSS_SELECTOR, "#content-main h2").text == (
        f"Cancel these {small_pages} runs:"
    )


def test_a_queue_is_paused_and_resumed_through_its_buttons(browser, live_server, operator):
    from selenium.webdriver.common.by import By

    t.add.enqueue(1, 2)
    page = live_server.url + reverse("admin:k2b_workflows_queuepause_changelist")
    browser.get(page)

    def row():
        return browser.find_element(By.CSS_SELECTOR, "tr[data-queue=default]")

    assert "active" in row().text
    row().find_element(By.NAME, "reason").send_keys("slow database")
    click_and_wait(browser, row().find_element(By.CSS_SELECTOR, "input[value=Pause]"))
    pause = QueuePause.objects.get(queue="default")
    assert (pause.reason, pause.paused_by) == ("slow database", "ravi")
    assert "paused" in row().text and "slow database" in row().text

    click_and_wait(browser, row().find_element(By.CSS_SELECTOR, "input[value=Resume]"))
    assert not QueuePause.objects.filter(queue="default").exists()
    assert "active" in row().text
