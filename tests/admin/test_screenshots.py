"""``make screenshots`` makes every picture the docs show, from the demo, in headless Chromium.

The docs' pictures were taken by hand and went stale with the admin; the
confirmation page of a resolution was not shown at all. Here: every image a
page shows is one the script makes, and the script, run against a database of
its own, makes them all.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from django.db import connection

from tests.support.database_url import database_url
from tests.support.sites import connect

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "screenshots.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("screenshots", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BY_THE_BROWSER_TEST = ("overview-light", "overview-dark")


def test_every_picture_the_docs_show_is_one_the_script_makes():
    shown = set()
    for page in (ROOT / "docs").glob("*.md"):
        shown |= set(re.findall(r"\]\(images/([\w-]+)\.png\)", page.read_text()))
    # The overview's two pictures are made by the browser test that checks the page
    # in light and dark mode (tests/admin/test_browser_overview.py), not by the script.
    assert shown - set(BY_THE_BROWSER_TEST) == set(_script().PICTURES)
    assert "resolution-confirm" in (ROOT / "docs" / "operators.md").read_text()
    for name in shown:
        assert (ROOT / "docs" / "images" / f"{name}.png").is_file(), name


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", header[16:24])


@pytest.mark.browser
@pytest.mark.slow
def test_the_script_makes_every_picture_from_the_demo(tmp_path):
    if not (Path("/usr/bin/chromium").exists() and shutil.which("/usr/bin/chromedriver")):
        pytest.skip("headless Chromium (/usr/bin/chromium, /usr/bin/chromedriver) is not installed")
    settings = connection.settings_dict
    name = f"{settings['NAME']}_shots{os.environ.get('PYTEST_XDIST_WORKER', '')}"[:50]
    with connect("postgres") as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    url = database_url(settings, name=name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "K2B_"))}
    env["DATABASE_URL"] = url
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        with connect(name) as conn:
            # The script stops on the confirmation page: the incident stays open.
            (open_incidents,) = conn.execute(
                "SELECT count(*) FROM k2b_run WHERE status = 'needs_attention'"
            ).fetchone()
    finally:
        with connect("postgres") as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    assert open_incidents == 1
    for picture in _script().PICTURES:
        width, height = _png_size(tmp_path / f"{picture}.png")
        assert width == 1400 and height >= 600, (picture, width, height)
        assert f"{picture}.png" in done.stdout
