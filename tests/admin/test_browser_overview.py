"""The overview page in a real browser, light and dark: the chart is drawn and readable.

Screenshots go to ``test-artifacts/overview-light.png`` and ``overview-dark.png``
(the docs show copies of them).
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection, transaction
from django.urls import reverse

from bench.overview import seed
from k2b_workflows import start_workflow_run
from k2b_workflows.models import WorkerRecord
from k2b_workflows.testing import run_until_idle
from tests.support.browser import click_and_wait, screenshot, set_theme

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def luminance(css_rgb: str) -> float:
    """Relative luminance (WCAG) of ``rgb(r, g, b)``."""
    r, g, b = (int(c) / 255 for c in css_rgb[css_rgb.index("(") + 1 : -1].split(",")[:3])

    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    return 0.2126 * linear(r) + 0.7152 * linear(g) + 0.0722 * linear(b)


def contrast(a: str, b: str) -> float:
    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


@pytest.fixture
def history() -> None:
    """An hour of runs (seeded rows), an incident, a failure."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT k2b_now()")
        (now,) = cursor.fetchone()
        cursor.execute("SET LOCAL session_replication_role = replica")
        seed(cursor, runs=6_000, recent=3_000, active=40, now=now)
    start_workflow_run("test.bad_result", {})
    start_workflow_run("kernel.blind_once", {})
    run_until_idle()


def live_worker() -> None:
    """A worker that beat just now (a stale heartbeat is not live: made right before the page)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT k2b_now()")
        (now,) = cursor.fetchone()
    WorkerRecord.objects.create(
        worker_id="web-1:4242",
        host="web-1",
        pid=4242,
        concurrency=8,
        in_flight=5,
        started_at=now,
        heartbeat_at=now,
    )


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_the_overview_draws_its_chart_readably_in_light_and_dark_mode(
    browser, live_server, history, theme
):
    from selenium.webdriver.common.by import By

    User.objects.create_user(
        "olga", password="night-shift-2024", is_staff=True
    ).user_permissions.add(Permission.objects.get(codename="view_workflowrun"))
    browser.delete_all_cookies()
    set_theme(browser, theme)
    browser.get(live_server.url + reverse("admin:login"))
    browser.find_element(By.NAME, "username").send_keys("olga")
    browser.find_element(By.NAME, "password").send_keys("night-shift-2024")
    click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, "input[type=submit]"))
    browser.get(live_server.url + reverse("admin:k2b_workflows_workflowrun_changelist"))
    live_worker()
    click_and_wait(
        browser, browser.find_element(By.CSS_SELECTOR, ".object-tools a[href$='/overview/']")
    )

    lines = browser.find_elements(By.CSS_SELECTOR, "svg.k2b-chart polyline")
    assert len(lines) == 3
    box = lines[0].rect
    assert box["width"] > 400 and box["height"] > 20  # drawn, with a visible rise
    incidents = browser.find_element(By.ID, "k2b-incidents").text
    assert "EFFECT_OUTCOME_UNKNOWN" in incidents
    assert "INVALID_ACTION_RESULT" in browser.find_element(By.ID, "k2b-failing").text
    assert "5 / 8" in browser.find_element(By.ID, "k2b-workers").text
    screenshot(browser, f"overview-{theme}")

    def style(selector: str, prop: str) -> str:
        element = browser.find_element(By.CSS_SELECTOR, selector)
        return browser.execute_script(
            "return getComputedStyle(arguments[0]).getPropertyValue(arguments[1])", element, prop
        )

    background = browser.execute_script("return getComputedStyle(document.body).backgroundColor")
    assert background == ("rgb(18, 18, 18)" if theme == "dark" else "rgb(255, 255, 255)")
    # Axis labels and every line stand out from the page in either theme.
    assert contrast(style("svg.k2b-chart .k2b-axis", "fill"), background) >= 3
    for css in ("k2b-line-started", "k2b-line-finished", "k2b-line-failed"):
        assert contrast(style(f"svg.k2b-chart .{css}", "stroke"), background) >= 3, css
    assert (
        contrast(
            style("#k2b-incidents h2", "color"), style("#k2b-incidents h2", "background-color")
        )
        >= 3
    )
