"""The Workers page in a real browser, with real worker processes: one busy, one killed.

The screenshot goes to ``test-artifacts/admin-workers.png``.
"""

from __future__ import annotations

import signal

import pytest
from django.contrib.auth.models import Permission, User
from django.urls import reverse

from k2b_workflows import start_workflow_run
from k2b_workflows.models import WorkerRecord
from tests.models import ProviderCall
from tests.support.browser import click_and_wait, screenshot, set_theme

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

TIMEOUT = 90


def test_the_on_call_engineer_sees_a_busy_worker_and_a_lost_one(
    browser, live_server, start_worker, wait
):
    from selenium.webdriver.common.by import By

    run = start_workflow_run("kernel.slow", {"seconds": 60})
    busy = start_worker("--concurrency", "2")
    wait(
        lambda: ProviderCall.objects.filter(action="kernel.slow").exists(),
        timeout=TIMEOUT,
        message=lambda: f"the slow step to start\n{busy.report()}",
    )
    doomed = start_worker("--concurrency", "1", "--app", "kernel_other")
    wait(
        lambda: WorkerRecord.objects.filter(pid=doomed.pid).exists(),
        timeout=TIMEOUT,
        message="the second worker to register",
    )
    doomed.signal(signal.SIGKILL)
    doomed.wait()
    wait(
        lambda: WorkerRecord.objects.filter(pid=doomed.pid, state="lost").exists(),
        timeout=TIMEOUT,
        message="the killed worker to be marked lost",
    )
    wait(
        lambda: WorkerRecord.objects.filter(pid=busy.pid, in_flight=1).exists(),
        timeout=TIMEOUT,
        message="the busy worker to report its run",
    )

    user = User.objects.create_user("olga", password="night-shift-2024", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="k2b_workflows",
            codename__in=["view_workflowrun", "view_workerrecord"],
        )
    )
    browser.delete_all_cookies()
    set_theme(browser, "light")
    browser.get(live_server.url + reverse("admin:login"))
    browser.find_element(By.NAME, "username").send_keys("olga")
    browser.find_element(By.NAME, "password").send_keys("night-shift-2024")
    click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, "input[type=submit]"))

    browser.get(live_server.url + reverse("admin:k2b_workflows_workerrecord_changelist"))
    rows = {
        r.find_element(By.CSS_SELECTOR, "th, td.field-worker_id").text: r.text
        for r in browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
    }
    alive = WorkerRecord.objects.get(pid=busy.pid)
    lost = WorkerRecord.objects.get(pid=doomed.pid)
    assert "alive" in rows[alive.worker_id] and "1/2" in rows[alive.worker_id]
    assert "lost" in rows[lost.worker_id] and "kernel_other" in rows[lost.worker_id]
    assert not browser.find_elements(By.CSS_SELECTOR, "a.addlink"), "read-only: no add button"
    path = screenshot(browser, "admin-workers")
    assert path.stat().st_size > 10_000

    browser.get(live_server.url + reverse("admin:k2b_workflows_workflowrun_change", args=[run.pk]))
    held_by = browser.find_element(By.CSS_SELECTOR, ".field-held_by").text
    assert alive.worker_id in held_by and "alive" in held_by
    screenshot(browser, "admin-run-held-by")
