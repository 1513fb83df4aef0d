#!/usr/bin/env python3
"""Take the documentation's screenshots of the admin from the demo, in headless Chromium.

Usage (``make screenshots`` sets DATABASE_URL and runs it from the repository)::

    python scripts/screenshots.py [--out docs/images]

Pictures taken by hand went stale as soon as the admin changed: the run page
and the resolution form in the docs showed a UI that no longer existed, and
the confirmation page was not shown at all. This script makes them again from
what the code renders today:

1. migrates the database and runs ``manage.py demo`` (seven runs: checkouts,
   a reconciled timeout, the bank payout that needs an operator),
2. starts one worker (``runworkflows``) so that the Workers page shows a live
   one, and ``runserver`` on a free local port,
3. logs in as the demo's ``admin`` and saves full-page PNGs of the run page,
   the incident queue, the resolution form, its confirmation page (it stops
   there: the incident stays open) and the Workers page.

Needs ``/usr/bin/chromium`` and ``/usr/bin/chromedriver`` (Debian: ``apt-get
install chromium chromium-driver``) and selenium (a dev dependency).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
#: Wide enough for the admin's tables without wrapping, as a laptop shows them.
WINDOW = (1400, 1000)
#: Seconds to wait for the server and for each page.
WAIT_S = 30

PICTURES = {
    "run-page": "a run page: timeline of steps, evidence ledger, budget",
    "incident-queue": "the incident queue",
    "resolution-form": "the resolution form of the bank payout",
    "resolution-confirm": "the confirmation page of a resolution",
    "workers": "the Workers page",
}


def manage(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        check=True,
        text=True,
        capture_output=True,
        **kwargs,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def background(*args: str) -> Iterator[subprocess.Popen[bytes]]:
    """A ``manage.py`` process for the duration of the block, stopped with SIGTERM."""
    process = subprocess.Popen(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for_server(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"runserver exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"runserver did not answer at {url} within {WAIT_S} s")


def browser() -> Any:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        raise SystemExit(
            "needs /usr/bin/chromium and /usr/bin/chromedriver "
            "(Debian: apt-get install chromium chromium-driver)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.implicitly_wait(5)
    # The admin follows the system's colour scheme: the docs show the light one.
    driver.execute_cdp_cmd(
        "Emulation.setEmulatedMedia",
        {"features": [{"name": "prefers-color-scheme", "value": "light"}]},
    )
    return driver


def open_page(driver: Any, url: str) -> None:
    from selenium.webdriver.support.wait import WebDriverWait

    driver.get(url)
    WebDriverWait(driver, WAIT_S).until(
        lambda d: d.execute_script("return document.readyState") == "complete"
    )


def submit(driver: Any, element: Any) -> None:
    """Click a button that loads a new page, and wait until that page has loaded."""
    from selenium.webdriver.support.wait import WebDriverWait

    driver.execute_script("window.k2bOldPage = true")
    element.click()
    WebDriverWait(driver, WAIT_S).until(
        lambda d: d.execute_script(
            "return window.k2bOldPage === undefined && document.readyState === 'complete'"
        )
    )


def save(driver: Any, out: Path, name: str) -> Path:
    """The whole page, not only the window (Chromium's DevTools protocol)."""
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
        },
    )
    path = out / f"{name}.png"
    path.write_bytes(base64.b64decode(shot["data"]))
    print(f"  {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {PICTURES[name]}")
    return path


def take(out: Path) -> list[Path]:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.urls import reverse
    from selenium.webdriver.common.by import By

    from k2b_workflows.models import WorkflowRun

    print("migrating and running the demo…")
    manage("migrate", "--noinput", "-v", "0")
    with tempfile.TemporaryDirectory() as tmp:
        manage("demo", "--log-file", str(Path(tmp) / "demo.log"))
    kettle = WorkflowRun.objects.filter(
        workflow_name="shop.checkout", input__sku="KETTLE", status="succeeded"
    ).latest("created_at")
    payout = WorkflowRun.objects.filter(
        workflow_name="shop.payout", status="needs_attention"
    ).latest("created_at")

    port = free_port()
    site = f"http://127.0.0.1:{port}"
    taken: list[Path] = []
    with (
        background("runworkflows", "--concurrency", "2"),
        background("runserver", f"127.0.0.1:{port}", "--noreload") as server,
    ):
        wait_for_server(site + reverse("admin:login"), server)
        driver = browser()
        try:
            open_page(driver, site + reverse("admin:login"))
            driver.find_element(By.NAME, "username").send_keys("admin")
            driver.find_element(By.NAME, "password").send_keys("admin")
            submit(driver, driver.find_element(By.CSS_SELECTOR, "input[type=submit]"))
            print(f"taking screenshots into {out}:")

            open_page(
                driver, site + reverse("admin:k2b_workflows_workflowrun_change", args=[kettle.pk])
            )
            taken.append(save(driver, out, "run-page"))

            open_page(driver, site + reverse("admin:k2b_workflows_incident_changelist"))
            taken.append(save(driver, out, "incident-queue"))

            open_page(
                driver, site + reverse("admin:k2b_workflows_incident_resolve", args=[payout.pk])
            )
            taken.append(save(driver, out, "resolution-form"))

            driver.find_element(
                By.CSS_SELECTOR, "input[name=decision][value=effect_absent]"
            ).click()
            driver.find_element(By.NAME, "evidence").send_keys(
                "Bank statement of 2 Dec: no payout of 125.00 with this reference."
            )
            submit(driver, driver.find_element(By.CSS_SELECTOR, "input[value^='Review']"))
            taken.append(save(driver, out, "resolution-confirm"))

            # The worker started above is the live one (its first heartbeat is at start).
            open_page(driver, site + reverse("admin:k2b_workflows_workerrecord_changelist"))
            taken.append(save(driver, out, "workers"))
        finally:
            driver.quit()
    return taken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs" / "images", help="directory for the PNG files"
    )
    args = parser.parse_args(argv)
    if not os.environ.get("DATABASE_URL"):
        raise SystemExit("DATABASE_URL is not set: run it as `make screenshots`")
    args.out.mkdir(parents=True, exist_ok=True)
    take(args.out.resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
