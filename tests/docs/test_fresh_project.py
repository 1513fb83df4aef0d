"""A brand-new ``startproject`` site, set up from the docs alone, tests its workflows.

The append-only tables refuse TRUNCATE, and Django's test teardown flushes
every table: in a project without this repository's conftest, every
``TransactionTestCase`` and every pytest-django ``transaction=True`` test
errored at teardown. This builds such a project in a temporary directory, with
only the settings getting-started.md and testing.md name, and runs the three
test styles in it against test databases its own test runners create. Then it
checks the other half of the promise on the site's real database: ``manage.py
flush`` and a plain ``TRUNCATE`` are still refused, and so is a flush from a
process that set up Django's test environment on a database its runner did not
create.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import k2b_workflows
from tests.support.doc_blocks import block
from tests.support.sites import connect, database_name, fresh_database, site_env, start_project

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
PACKAGE_ROOT = Path(k2b_workflows.__file__).resolve().parent.parent

WORKFLOWS = """
from k2b_workflows import Action, Effect, succeeded, workflow


class Reserve(Action):
    name = "orders.reserve"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True}, summary="reserve")

    def run(self, ctx, input):
        return succeeded({"reserved": input["sku"]})

    def reconcile(self, ctx, input):
        return succeeded({"reserved": input["sku"]})


@workflow("orders.place", app_id="orders", effect_budget={"charges": 1})
def place(run, input):
    return run.step(Reserve, {"sku": input["sku"]})


class Charge(Action):
    name = "orders.charge"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True}, summary="charge")

    def run(self, ctx, input):
        raise ConnectionResetError("connection reset after the request was sent")


@workflow("orders.charge", app_id="orders")
def charge(run, input):
    return run.step(Charge, {})
"""

DJANGO_TESTS = """
from django.test import TestCase, TransactionTestCase

from k2b_workflows import start_workflow_run
from k2b_workflows.models import JournalEntry, LedgerEntry
from k2b_workflows.testing import assert_effect_once, run_until_idle


class PlaceMixin:
    def test_a_run_writes_journal_and_ledger(self):
        run = start_workflow_run("orders.place", {"sku": "TEA"})
        run_until_idle()
        run.refresh_from_db()
        self.assertEqual(run.status, "succeeded")
        assert_effect_once(run, 0)
        self.assertEqual(JournalEntry.objects.count(), 1)

    def test_b_the_next_test_starts_empty(self):
        self.assertEqual(LedgerEntry.objects.count(), 0)
        self.test_a_run_writes_journal_and_ledger()


class PlaceTestCase(PlaceMixin, TestCase):
    pass


class PlaceTransactionTestCase(PlaceMixin, TransactionTestCase):
    pass


class WaitingViewMixin:
    def test_a_view_that_waits_answers_with_the_result(self):
        run = start_workflow_run("orders.place", {"sku": "TEA"})
        run_until_idle()
        answer = self.client.get(f"/orders/{run.pk}/result")
        self.assertEqual(answer.json(), {"status": "succeeded"})


class WaitingViewTestCase(WaitingViewMixin, TestCase):
    pass


class WaitingViewTransactionTestCase(WaitingViewMixin, TransactionTestCase):
    pass
"""

#: A view that waits for a run's result: the waiting opens the result listener's connection.
VIEWS = """
from django.http import JsonResponse
from django.urls import path

from k2b_workflows import wait_for_workflow_run


def result(request, run_id):
    try:
        run = wait_for_workflow_run(run_id, timeout=5)
    except TimeoutError:
        return JsonResponse({"status": "pending"}, status=202)
    return JsonResponse({"status": run.status})


urlpatterns = [path("orders/<uuid:run_id>/result", result)]
"""

PYTEST_TESTS = """
import pytest

from k2b_workflows import start_workflow_run
from k2b_workflows.models import JournalEntry
from k2b_workflows.testing import run_until_idle


def place():
    run = start_workflow_run("orders.place", {"sku": "TEA"})
    run_until_idle()
    run.refresh_from_db()
    assert run.status == "succeeded"
    assert JournalEntry.objects.count() == 1


@pytest.mark.django_db
def test_in_the_test_transaction():
    place()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("attempt", [1, 2])
def test_committed_and_flushed(attempt, k2b_clock):
    place()


@pytest.mark.django_db
@pytest.mark.parametrize("attempt", [1, 2])
def test_a_view_that_waits(attempt, client):
    run = start_workflow_run("orders.place", {"sku": "TEA"})
    run_until_idle()
    assert client.get(f"/orders/{run.pk}/result").json() == {"status": "succeeded"}


@pytest.mark.django_db(transaction=True)
def test_a_view_that_waits_on_a_committed_run(client):
    run = start_workflow_run("orders.place", {"sku": "TEA"})
    run_until_idle()
    assert client.get(f"/orders/{run.pk}/result").json() == {"status": "succeeded"}
"""

#: What the site adds to getting-started.md's settings (``tests/support/sites.py``).
SETTINGS = """ROOT_URLCONF = "orders.views"
"""

#: pytest-django's own documented setup, and the plugin named on its command line.
PYTEST_INI = """
[pytest]
DJANGO_SETTINGS_MODULE = freshsite.settings
addopts = -p k2b_workflows.pytest_plugin -p no:cacheprovider
"""


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _test_databases_left(name: str) -> list[str]:
    """The test databases (and ``--parallel`` clones) of the site's database still on the server."""
    with connect("postgres") as conn:
        rows = conn.execute(
            "SELECT datname FROM pg_catalog.pg_database WHERE datname LIKE %s ORDER BY 1",
            [f"test_{name}%"],
        ).fetchall()
    return [row[0] for row in rows]


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str], str]]:
    name = database_name("site")
    orders = start_project(
        BIN / "django-admin", "freshsite", tmp_path, app="orders", database=name, settings=SETTINGS
    )
    (orders / "workflows.py").write_text(WORKFLOWS)
    (orders / "tests.py").write_text(DJANGO_TESTS)
    (orders / "test_pytest.py").write_text(PYTEST_TESTS)
    (orders / "views.py").write_text(VIEWS)
    # docs/testing.md's TransactionTestCase, as the page shows it.
    shown = block("docs/testing.md", "# orders/tests.py, run by manage.py test").code
    (orders / "test_docs_page.py").write_text(shown)
    (tmp_path / "pytest.ini").write_text(PYTEST_INI)
    env = site_env()
    # The site, then the tree whose k2b_workflows is under test (an installed
    # copy elsewhere, e.g. the editable install of another checkout, must not win).
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(PACKAGE_ROOT)])
    with fresh_database(name, also_drop=lambda: _test_databases_left(name)):
        yield tmp_path, env, name


@pytest.mark.parametrize("parallel", ["1", "2"])
def test_djangos_testcase_and_transactiontestcase_pass_in_a_fresh_project(site, parallel):
    path, env, name = site
    done = _run(
        [
            sys.executable,
            "manage.py",
            "test",
            "orders",
            "--noinput",
            "-v",
            "2",
            "--parallel",
            parallel,
        ],
        path,
        env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"Ran 7 tests .*\n+OK", done.stderr), done.stderr
    # The views' waits opened the result listener; it let the test databases go.
    assert "being accessed by other users" not in done.stderr, done.stderr
    assert _test_databases_left(name) == [], done.stderr
    if parallel != "1":  # the transactional tests flushed clones of the test database
        assert "Cloning test database" in done.stderr, done.stderr
    assert re.search(r"test_a_run_reserves_once .*PlaceOrderTests.* ok", done.stderr)
    for test in ("PlaceTestCase", "PlaceTransactionTestCase"):
        assert re.search(rf"test_b_the_next_test_starts_empty .*{test}.* ok", done.stderr)


def test_pytest_django_with_and_without_transaction_passes_in_a_fresh_project(site):
    path, env, name = site
    done = _run(
        [sys.executable, "-m", "pytest", "orders/test_pytest.py", "--create-db", "-v"], path, env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 passed" in done.stdout, done.stdout
    assert "teardown" not in (done.stdout + done.stderr).lower(), done.stdout + done.stderr
    assert _test_databases_left(name) == [], done.stdout + done.stderr
    assert "error" not in done.stdout.lower(), done.stdout


def test_flush_and_truncate_stay_refused_on_the_fresh_projects_own_database(site):
    path, env, name = site
    migrate = _run([sys.executable, "manage.py", "migrate", "--noinput"], path, env)
    assert migrate.returncode == 0, migrate.stderr
    started = _run(
        [
            sys.executable,
            "-c",
            "import django; django.setup(); from k2b_workflows import start_workflow_run; "
            "from k2b_workflows.testing import run_until_idle; "
            "start_workflow_run('orders.place', {'sku': 'TEA'}); run_until_idle()",
        ],
        path,
        {**env, "DJANGO_SETTINGS_MODULE": "freshsite.settings"},
    )
    assert started.returncode == 0, started.stderr

    flush = _run([sys.executable, "manage.py", "flush", "--noinput"], path, env)
    assert flush.returncode != 0
    assert f"flush refused on database '{name}'" in flush.stderr, flush.stderr

    # A process that set up Django's test environment itself, on a database
    # its test runner did not create: refused too.
    in_test_env = _run(
        [
            sys.executable,
            "-c",
            "import django; django.setup(); from django.test.utils import "
            "setup_test_environment; setup_test_environment(); "
            "from django.core.management import call_command; "
            "call_command('flush', interactive=False)",
        ],
        path,
        {**env, "DJANGO_SETTINGS_MODULE": "freshsite.settings"},
    )
    assert in_test_env.returncode != 0
    assert "flush refused" in in_test_env.stderr, in_test_env.stderr

    with connect(name) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
            conn.execute("TRUNCATE k2b_journal, k2b_ledger CASCADE")
        journal = conn.execute("SELECT count(*) FROM k2b_journal").fetchone()
        ledger = conn.execute("SELECT count(*) FROM k2b_ledger").fetchone()
    assert journal == (1,) and ledger is not None and ledger[0] >= 2


def _migrate_and_start(path: Path, env: dict[str, str], *names: str) -> None:
    migrate = _run([sys.executable, "manage.py", "migrate", "--noinput"], path, env)
    assert migrate.returncode == 0, migrate.stderr
    started = _run(
        [
            sys.executable,
            "-c",
            "import django, sys; django.setup(); from k2b_workflows import start_workflow_run; "
            "[start_workflow_run(name, {'sku': 'TEA'}) for name in sys.argv[1:]]",
            *names,
        ],
        path,
        {**env, "DJANGO_SETTINGS_MODULE": "freshsite.settings"},
    )
    assert started.returncode == 0, started.stderr


def test_a_worker_without_logging_config_prints_its_start_stop_and_doubts_to_stderr(site):
    path, env, _ = site
    _migrate_and_start(path, env, "orders.place", "orders.charge")

    done = _run([sys.executable, "manage.py", "runworkflows", "--burst"], path, env)

    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert any(
        re.search(r"INFO k2b_workflows: worker \S+: 4 thread\(s\), apps all", x) for x in lines
    ), done.stderr
    assert any(
        re.search(r"INFO k2b_workflows: worker \S+ stopped: \{.*'runs': 2", x) for x in lines
    ), done.stderr
    # The effect in doubt is a warning; the per-step progress (claimed, journaled) is not printed.
    assert any("WARNING k2b_workflows.events" in x and "outcome_unknown" in x for x in lines), (
        done.stderr
    )
    assert not any("claimed (generation" in x for x in lines), done.stderr


def test_log_format_json_prints_one_object_per_line_with_the_runs_fields(site):
    path, env, _ = site
    _migrate_and_start(path, env, "orders.charge")

    done = _run(
        [sys.executable, "manage.py", "runworkflows", "--burst", "--log-format", "json"], path, env
    )

    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines()]
    messages = [r["message"] for r in records]
    assert any(re.fullmatch(r"worker \S+: 4 thread\(s\), apps all, .*", m) for m in messages)
    assert any(re.fullmatch(r"worker \S+ stopped: .*", m) for m in messages)
    doubt = [r for r in records if r["logger"] == "k2b_workflows.events"]
    assert doubt and doubt[0]["level"] == "WARNING" and doubt[0]["workflow"] == "orders.charge"
    assert doubt[0]["effect_key"].endswith(":0")


def test_log_format_is_refused_when_unknown(site):
    path, env, _ = site
    done = _run([sys.executable, "manage.py", "runworkflows", "--log-format", "xml"], path, env)
    assert done.returncode != 0
    assert "--log-format: invalid choice: 'xml'" in done.stderr
