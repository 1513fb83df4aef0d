"""Headless Chromium for the browser tests: one browser per module, skipped where Chromium is
missing; clicks that wait for the next page, themes, screenshots into ``test-artifacts/``."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")


CHROMEDRIVER = Path("/usr/bin/chromedriver")


ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()) or shutil.which(str(CHROMIUM)) is None:
        pytest.skip("headless Chromium (/usr/bin/chromium, /usr/bin/chromedriver) is not installed")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    # Console messages, where Chromium reports Content-Security-Policy violations.
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.implicitly_wait(5)
    try:
        yield driver
    finally:
        driver.quit()


def click_and_wait(browser, element) -> None:
    """Click something that loads a new page, and wait until the new page has loaded.

    The old page is marked with a window property that a new page does not
    have; polling for it (rather than for a stale element) never races with
    Chromium tearing the old document down.
    """
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.support.wait import WebDriverWait

    browser.execute_script("window.k2bOldPage = true")
    element.click()

    def loaded(driver) -> bool:
        try:
            return driver.execute_script(
                "return window.k2bOldPage === undefined && document.readyState === 'complete'"
            )
        except WebDriverException:
            return False

    WebDriverWait(browser, 15).until(loaded)


def set_theme(browser, theme: str) -> None:
    """Emulate the operating system's colour scheme, which the admin follows by default."""
    browser.execute_cdp_cmd(
        "Emulation.setEmulatedMedia",
        {"features": [{"name": "prefers-color-scheme", "value": theme}]},
    )


def screenshot(browser, name: str) -> Path:
    """The whole page, not only the viewport (Chromium's DevTools protocol)."""
    import base64

    ARTIFACTS.mkdir(exist_ok=True)
    size = browser.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    shot = browser.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
        },
    )
    path = ARTIFACTS / f"{name}.png"
    path.write_bytes(base64.b64decode(shot["data"]))
    return path


def csp_violations(browser) -> list[str]:
    """Console messages about the Content-Security-Policy since the last call."""
    return [
        entry["message"]
        for entry in browser.get_log("browser")
        if "Content Security Policy" in entry["message"] or "Refused to" in entry["message"]
    ]


def signed_in(
    browser, live_server, username: str, password: str, codenames: list[str], *, theme=None
):
    """A staff user with the app's permissions ``codenames``, logged in to the admin in
    ``browser`` (after the colour scheme ``theme``, if given, is set)."""
    from django.contrib.auth.models import Permission, User
    from django.urls import reverse
    from selenium.webdriver.common.by import By

    user = User.objects.create_user(username, password=password, is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="k2b_workflows", codename__in=codenames)
    )
    browser.delete_all_cookies()
    if theme is not None:
        set_theme(browser, theme)
    browser.get(live_server.url + reverse("admin:login"))
    browser.find_element(By.NAME, "username").send_keys(username)
    browser.find_element(By.NAME, "password").send_keys(password)
    click_and_wait(browser, browser.find_element(By.CSS_SELECTOR, "input[type=submit]"))
    assert browser.find_element(By.ID, "user-tools").text.upper().startswith("WELCOME")
    return user
