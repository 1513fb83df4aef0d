"""The operators' admin in a real browser: headless Chromium driven by Selenium.

An operator logs in, opens the incident queue, resolves one incident as
"effect absent" (the run is queued again) and another as "effect confirmed"
with an output (the run completes). Screenshots of the run page, the queue
and the resolution form, in light and dark mode, go to ``test-artifacts/``.
"""

from __future__ import annotations

import django
import pytest
from django.contrib.auth.models import Permission, User
from django.urls import reverse

from k2b_workflows import start_workflow_run
from k2b_workflows.models import LedgerEntry, WorkflowRun
from k2b_workflows.testing import run_until_idle
from tests.support.browser import click_and_wait, csp_violations, screenshot, set_theme, signed_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def signed_in_operator(browser, live_server) -> User:
    """An on-call engineer with the permissions of an operator, logged in."""
    return signed_in(
        browser,
        live_server,
        "olga",
        "night-shift-2024",
        ["view_workflowrun", "resolve_effect", "cancel_workflowrun", "dry_run_workflow"],
        theme="light",
    )


def make_incident() -> WorkflowRun:
    run = start_workflow_run("test.charge_blind", {"behaviour": "ambiguous", "amount": 4200})
    run_until_idle()
    run.refresh_from_db()
    assert run.status == "needs_attention"
    return run


def open_resolution_form(browser, live_server, run: WorkflowRun) -> None:
    from selenium.webdriver.common.by import By

    browser.get(live_server.url + reverse("admin:k2b_workflows_incident_changelist"))
    row = browser.find_element(By.XPATH, f"//tr[.//a[contains(@href, '{run.pk}')]]")
    click_and_wait(browser, row.find_element(By.LINK_TEXT, "Resolve…"))
    assert browser.find_element(By.TAG_NAME, "h1").text.startswith("Resolve step 0")


def fill_and_confirm(browser, decision: str, evidence: str, output: str = "") -> None:
    from selenium.webdriver.common.by import By

    browser.find_element(By.CSS_SELECTOR, f"input[name=decision][value={decision}]").click()
    browser.find_element(By.NAME, "evidence").send_keys(evidence)
    if output:
        browser.find_element(By.NAME, "output").send_keys(output)
    click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, "input[value^='Review']"))
    assert browser.find_element(By.TAG_NAME, "h1").text.startswith("Confirm: Resolve step 0")
    click_and_wait(browser, browser.find_element(By.NAME, "_confirm"))


def test_operator_resolves_an_incident_as_effect_absent_and_the_run_is_requeued(
    browser, live_server, signed_in_operator
):
    from selenium.webdriver.common.by import By

    first, second = make_incident(), make_incident()
    browser.get(live_server.url + reverse("admin:k2b_workflows_incident_changelist"))
    rows = browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
    assert [r.find_element(By.CSS_SELECTOR, ".field-incident a").text for r in rows] == [
        str(first.pk)[:8],
        str(second.pk)[:8],
    ]

    open_resolution_form(browser, live_server, first)
    fill_and_confirm(browser, "effect_absent", "Stripe dashboard: no charge with this key.")

    assert "effect absent recorded" in browser.find_element(By.CSS_SELECTOR, ".messagelist").text
    badge = browser.find_element(By.CSS_SELECTOR, ".field-status_badge .k2b-badge")
    assert badge.text.lower() == "queued"
    first.refresh_from_db()
    assert first.status == "queued"
    assert LedgerEntry.objects.get(run=first, kind="resolved_absent").actor == "olga"


def test_operator_confirms_an_effect_with_its_output_and_the_run_completes(
    browser, live_server, signed_in_operator
):
    from selenium.webdriver.common.by import By

    run = make_incident()
    open_resolution_form(browser, live_server, run)
    fill_and_confirm(
        browser,
        "effect_confirmed",
        "Provider support confirmed charge ch_77.",
        '{"charge_id": "ch_77"}',
    )
    assert "effect confirmed recorded" in browser.find_element(By.CSS_SELECTOR, ".messagelist").text

    run_until_idle()
    browser.refresh()
    badge = browser.find_element(By.CSS_SELECTOR, ".field-status_badge .k2b-badge")
    assert badge.text.lower() == "succeeded"
    assert "ch_77" in browser.find_element(By.CSS_SELECTOR, ".field-output_json").text
    states = [
        td.text for td in browser.find_elements(By.CSS_SELECTOR, ".k2b-timeline td .k2b-state")
    ]
    assert states == ["succeeded", "succeeded"]


def test_malformed_output_is_shown_as_a_form_error_in_the_browser(
    browser, live_server, signed_in_operator
):
    from selenium.webdriver.common.by import By

    run = make_incident()
    open_resolution_form(browser, live_server, run)
    browser.find_element(By.CSS_SELECTOR, "input[name=decision][value=effect_confirmed]").click()
    browser.find_element(By.NAME, "evidence").send_keys("Looked it up.")
    browser.find_element(By.NAME, "output").send_keys('{"charge_id": ')
    click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, "input[value^='Review']"))
    assert (
        "not valid JSON" in browser.find_element(By.CSS_SELECTOR, ".field-output .errorlist").text
    )
    run.refresh_from_db()
    assert run.status == "needs_attention"


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_screens_render_in_light_and_dark_mode(browser, live_server, signed_in_operator, theme):
    """Saves screenshots to look at; asserts the theme really applied to our own styles."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.select import Select

    done = make_incident()
    pending = make_incident()
    # One resolved and completed run, so the run page has a full timeline and ledger.
    open_resolution_form(browser, live_server, done)
    fill_and_confirm(
        browser,
        "effect_confirmed",
        "Confirmed on the provider's dashboard.",
        '{"charge_id": "ch_1"}',
    )
    run_until_idle()
    set_theme(browser, theme)

    browser.get(live_server.url + reverse("admin:k2b_workflows_incident_changelist"))
    screenshot(browser, f"incident-queue-{theme}")

    open_resolution_form(browser, live_server, pending)
    screenshot(browser, f"resolution-form-{theme}")
    browser.find_element(By.CSS_SELECTOR, "input[name=decision][value=effect_absent]").click()
    browser.find_element(By.NAME, "evidence").send_keys("No charge on the dashboard.")
    click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, "input[value^='Review']"))
    screenshot(browser, f"resolution-confirm-{theme}")

    browser.get(
        live_server.url + reverse("admin:k2b_workflows_workflowrun_change", args=[pending.pk])
    )
    screenshot(browser, f"run-page-incident-{theme}")
    browser.get(live_server.url + reverse("admin:k2b_workflows_workflowrun_change", args=[done.pk]))
    screenshot(browser, f"run-page-succeeded-{theme}")
    browser.get(live_server.url + reverse("admin:k2b_workflows_workflowrun_changelist"))
    screenshot(browser, f"runs-changelist-{theme}")
    browser.get(live_server.url + reverse("admin:k2b_workflows_workflowrun_dry_run"))
    Select(browser.find_element(By.NAME, "workflow")).select_by_value("test.charge")
    field = browser.find_element(By.NAME, "input")
    field.clear()
    field.send_keys('{"amount": 1200}')
    click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, "input[value='Dry run']"))
    screenshot(browser, f"dry-run-{theme}")

    body_bg = browser.execute_script("return getComputedStyle(document.body).backgroundColor")
    assert body_bg == ("rgb(18, 18, 18)" if theme == "dark" else "rgb(255, 255, 255)")
    badge = browser.find_element(By.CSS_SELECTOR, ".k2b-badge.k2b-status-succeeded")
    badge_bg = browser.execute_script(
        "return getComputedStyle(arguments[0]).backgroundColor", badge
    )
    assert badge_bg == ("rgb(0, 107, 27)" if theme == "dark" else "rgb(221, 255, 221)")


@pytest.mark.skipif(django.VERSION < (6, 0), reason="Django 5.2 has no CSP middleware")
def test_admin_screens_run_under_a_strict_content_security_policy(
    browser, live_server, signed_in_operator
):
    from urllib.request import urlopen

    from selenium.webdriver.common.by import By

    header = urlopen(live_server.url + reverse("admin:login")).headers["Content-Security-Policy"]
    assert "script-src 'self'" in header
    done, pending = make_incident(), make_incident()
    csp_violations(browser)  # drop what the login produced
    open_resolution_form(browser, live_server, done)
    fill_and_confirm(browser, "effect_confirmed", "Seen on the dashboard.", '{"charge_id": "c"}')
    run_until_idle()
    pages = [
        reverse("admin:k2b_workflows_incident_changelist"),
        reverse("admin:k2b_workflows_workflowrun_changelist"),
        reverse("admin:k2b_workflows_workflowrun_change", args=[done.pk]),
        reverse("admin:k2b_workflows_workflowrun_change", args=[pending.pk]),
        reverse("admin:k2b_workflows_workflowrun_dry_run"),
    ]
    for page in pages:
        browser.get(live_server.url + page)
        assert browser.find_element(By.ID, "content")
    open_resolution_form(browser, live_server, pending)
    assert csp_violations(browser) == []

    # The check can fail: an inline script injected into the page is refused and reported.
    browser.execute_script(
        "const s = document.createElement('script'); s.textContent = 'window.x = 1';"
        " document.head.appendChild(s);"
    )
    assert csp_violations(browser)


def test_a_nondeterminism_incident_offers_retry_and_cancel_and_retry_requeues_it(
    browser, live_server, signed_in_operator, monkeypatch
):
    """The incident page of #10: the journaled step beside the code's, and its real actions."""
    from selenium.webdriver.common.by import By

    from k2b_workflows import wake_workflow_runs_waiting_on
    from tests.models import DomainRow

    signed_in_operator.user_permissions.add(
        Permission.objects.get(
            content_type__app_label="k2b_workflows", codename="retry_workflowrun"
        )
    )
    monkeypatch.delenv("K2B_TEST_REORDERED", raising=False)
    run = start_workflow_run("ver.reordered", {"key": "reordered"})
    run_until_idle()
    monkeypatch.setenv("K2B_TEST_REORDERED", "1")  # a deploy moved the wait before step 0
    DomainRow.objects.create(key="reordered")
    wake_workflow_runs_waiting_on(app_id="versions", kind="signal", key="reordered")
    run_until_idle()
    run.refresh_from_db()
    assert run.error_code == "WORKFLOW_NONDETERMINISTIC"

    browser.get(live_server.url + reverse("admin:k2b_workflows_incident_changelist"))
    row = browser.find_element(By.XPATH, f"//tr[.//a[contains(@href, '{run.pk}')]]")
    assert not row.find_elements(By.LINK_TEXT, "Resolve…")
    click_and_wait(browser, row.find_element(By.CSS_SELECTOR, ".field-incident a"))
    box = browser.find_element(By.ID, "k2b-incident")
    assert "The workflow code no longer matches the journal" in box.text
    cells = [td.text for td in box.find_elements(By.CSS_SELECTOR, ".k2b-divergence td")]
    assert cells[:2] == ["ver.stamp", "test.wait_for"]
    actions = [a.text for a in box.find_elements(By.CSS_SELECTOR, ".k2b-incident-actions a")]
    assert actions == ["Retry…", "Cancel…"]
    path = screenshot(browser, "nondeterminism-incident")
    assert path.stat().st_size > 0

    monkeypatch.setenv("K2B_TEST_REORDERED", "0")  # the fix is deployed
    click_and_wait(browser, box.find_element(By.LINK_TEXT, "Retry…"))
    browser.find_element(By.NAME, "reason").send_keys("Deployed the original order back.")
    click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, "input[value='Yes, retry now']"))
    assert "Retry now: 1 run(s)." in browser.find_element(By.CSS_SELECTOR, ".messagelist").text
    run_until_idle()
    run.refresh_from_db()
    assert run.status == "succeeded"
