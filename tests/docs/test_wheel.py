"""The wheel ``make dist`` builds is the package, whole, and a bare venv runs it (#38).

The package is not on PyPI: getting-started.md installs it from this wheel. A
template, a static file or a migration that package data leaves out works in every
test of this repository (they import the source tree) and breaks the first site
that installs the wheel. So the wheel is built here, its files are compared with
the package's files on disk, twine checks it as PyPI would, and a fresh venv with
nothing but the wheel and its dependencies migrates a new site and runs
getting-started.md's checkout against PostgreSQL.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import k2b_workflows
from tests.support.doc_blocks import section
from tests.support.sites import database_name, fresh_database, site_env, start_project

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(k2b_workflows.__file__).resolve().parent

#: What builds, tools and runs leave in a checkout; a fresh clone has none of it.
LEFT_BY_TOOLS = (
    ".git",
    ".venv",
    ".venv-dist",
    ".tox",
    ".pgdata",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    "test-artifacts",
)

#: The page's checkout, started and run to the end, as its test does.
CHECKOUT = """
from k2b_workflows import start_workflow_run
from k2b_workflows.testing import run_until_idle
from shop.providers import gateway

run = start_workflow_run("shop.checkout", {"sku": "TEA-01", "amount": 2900})
run_until_idle()
run.refresh_from_db()
print("checkout", run.status, run.output, "charges:", len(gateway.charges))
"""


def _run(args: list[str | Path], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"{args}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _package_files() -> set[str]:
    """Every file of the package on disk, as the wheel names it (bytecode aside)."""
    return {
        path.relative_to(PACKAGE.parent).as_posix()
        for path in PACKAGE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As ``make dist`` builds it on a fresh clone: the sdist, then the wheel from the
    unpacked sdist. Built from a copy of the tree without what builds and tools
    leave there: in a working tree setuptools also takes what an earlier build left
    in ``build/`` and ``*.egg-info/SOURCES.txt``, which hid a file package data missed."""
    source = tmp_path_factory.mktemp("source") / "tree"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*LEFT_BY_TOOLS))
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", out, source], source)
    (built,) = out.glob("k2b_workflows-*.whl")
    return built


def test_the_wheel_holds_every_file_of_the_package_and_passes_twine_check(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    packaged = {name for name in names if name.startswith("k2b_workflows/")}
    assert _package_files() - packaged == set()
    assert "k2b_workflows/py.typed" in packaged
    assert any(name.startswith("k2b_workflows/migrations/0001_") for name in packaged)
    assert any(name.startswith("k2b_workflows/templates/") for name in packaged)
    assert any(name.startswith("k2b_workflows/static/") for name in packaged)
    (sdist,) = wheel.parent.glob("k2b_workflows-*.tar.gz")
    checked = _run([sys.executable, "-m", "twine", "check", "--strict", wheel, sdist], ROOT)
    assert checked.count("PASSED") == 2, checked


def test_getting_started_installs_the_wheel_make_dist_builds_and_names_no_unknown_host(wheel):
    """Its install lines once named ``git+https://YOUR-GIT-HOST/...``, a host no reader
    has (#38): they build the wheel with ``make dist`` and install that file."""
    page = (ROOT / "docs" / "getting-started.md").read_text()
    install = page.split("## Install", 1)[1].split("```python", 1)[0]
    assert "make dist" in install
    assert re.search(r"^dist: ", (ROOT / "Makefile").read_text(), re.M)
    (named,) = re.findall(r"dist/(k2b_workflows-\S+\.whl)", install)
    assert named == wheel.name
    assert not re.search(r"YOUR-|example\.com|github\.com", install), install


def test_a_bare_venv_with_the_wheel_migrates_a_site_and_runs_the_getting_started_checkout(
    wheel, tmp_path
):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp_path)
    python = venv / "bin" / "python"
    # pip's own configuration (the local indexes and /opt/wheels here) serves the
    # dependencies; the package itself can only come from the wheel.
    _run([python, "-m", "pip", "install", "-q", wheel], tmp_path)
    where = _run([python, "-c", "import k2b_workflows; print(k2b_workflows.__file__)"], tmp_path)
    assert where.strip().startswith(str(venv)), where

    site = tmp_path / "site"
    site.mkdir()
    name = database_name("wheel")
    shop = start_project(venv / "bin" / "django-admin", "shopsite", site, app="shop", database=name)
    (shop / "models.py").write_text(
        "from django.db import models\n\n\nclass Order(models.Model):\n"
        "    sku = models.CharField(max_length=50)\n"
    )
    (shop / "providers.py").write_text((ROOT / "docs" / "examples" / "providers.py").read_text())
    (shop / "workflows.py").write_text(section("docs/examples/getting_started.py:workflows"))
    env = site_env(drop_prefixes=("COV_", "COVERAGE_"), drop=("PYTHONPATH",))
    with fresh_database(name):
        _run([python, "manage.py", "makemigrations", "shop"], site, env)
        _run([python, "manage.py", "migrate", "--noinput"], site, env)
        out = _run([python, "manage.py", "shell", "-c", CHECKOUT], site, env)
    assert "checkout succeeded {'order': 1, 'charge': 'ch_1'} charges: 1" in out, out
