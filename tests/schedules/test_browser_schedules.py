"""The Schedules page in a real browser: the next five fire times follow the spec as it is typed.

Screenshots of the list and of a schedule's page go to ``test-artifacts/``.
"""

from __future__ import annotations

import datetime as dt

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

from k2b_workflows import Schedule, schedule_workflow
from k2b_workflows.models import WorkflowScheduleSkip
from k2b_workflows.scheduling import run_schedule_now
from tests.support.browser import (
    csp_violations,
    screenshot,
    signed_in,
)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

#: Seconds the preview may take to follow what is typed (an upper bound, not a sleep).
PREVIEW_WAIT = 30


@pytest.fixture
def scheduler(browser, live_server) -> User:
    return signed_in(
        browser,
        live_server,
        "sam",
        "cron-and-coffee",
        [
            "view_workflowschedule",
            "change_workflowschedule",
            "pause_workflowschedule",
            "run_workflowschedule",
            "view_workflowrun",
        ],
        theme="light",
    )


def test_the_preview_follows_the_cron_as_it_is_typed(browser, live_server, scheduler):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.wait import WebDriverWait

    nightly = schedule_workflow(
        "reports-nightly",
        "sched.echo",
        Schedule("0 3 * * *", timezone="Europe/Berlin", input={"kind": "daily"}),
    )
    schedule_workflow("tenant-42-digest", "sched.echo", Schedule(every=dt.timedelta(hours=1)))
    paused = schedule_workflow(
        "tenant-7-digest", "sched.echo", Schedule(every=dt.timedelta(hours=1))
    )
    paused.paused = True
    paused.save()
    run_schedule_now(nightly)
    WorkflowScheduleSkip.objects.create(
        schedule=nightly, first_tick=nightly.anchor, last_tick=nightly.anchor, reason="overlap"
    )
    csp_violations(browser)

    browser.get(live_server.url + reverse("admin:k2b_workflows_workflowschedule_changelist"))
    screenshot(browser, "schedules-list")
    browser.get(
        live_server.url + reverse("admin:k2b_workflows_workflowschedule_change", args=[nightly.pk])
    )

    def items() -> list[str]:
        # The list's texts in one read: the page replaces its items as each answer
        # comes, and an item found before a replacement and read after it is stale
        # (StaleElementReferenceException, seen under make test).
        return browser.execute_script(
            "return Array.from(document.querySelectorAll('#k2b-schedule-preview li'),"
            " (item) => item.innerText)"
        )

    saved = items()
    assert len(saved) == 5

    cron = browser.find_element(By.ID, "id_cron")
    cron.clear()
    cron.send_keys("30 6 * * 1-5")
    # Each answer is a debounced fetch to the live server: on a loaded machine with a
    # browser just started, seconds. The wait ends as soon as it is shown.
    shown: list[str] = []

    def followed(_: object) -> bool:
        shown[:] = items()
        return shown != saved and len(shown) == 5

    WebDriverWait(browser, PREVIEW_WAIT).until(followed)
    typed = shown
    assert len({t.split()[0] for t in typed}) == 5  # five different days
    screenshot(browser, "schedule-page")

    cron.clear()
    cron.send_keys("61 * * * *")
    WebDriverWait(browser, PREVIEW_WAIT).until(lambda d: "Bad minute" in " ".join(items()))
    assert csp_violations(browser) == []
