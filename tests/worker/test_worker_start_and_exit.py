"""A worker's start and end cost what they must and nothing more.

- The schema check reads ``django_migrations``; Django's migration planner
  (every installed app's migrations imported, their graph built) decides only
  what that read cannot: a migration of this app not recorded as applied.
- ``manage.py runworkflows`` ends the process as the interpreter would (its
  non-daemon threads joined, its ``atexit`` handlers run, every line written,
  the status of ``sys.exit``) but without tearing down its modules, which cost
  a quarter of a second and served nobody.
- The topology probes run beside the first claim, and their lines still come
  before the worker's last one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from django.db import connection

from k2b_workflows import DatabaseNotMigrated
from k2b_workflows.kernel import db
from tests.support.processes import ROOT

# -- the schema check -------------------------------------------------------------


@pytest.mark.django_db
def test_a_migrated_database_is_told_by_its_reads_without_the_planner(monkeypatch):
    from django.db.migrations import executor

    def planner(*args, **kwargs):
        raise AssertionError("the migration planner ran for a database fully migrated")

    monkeypatch.setattr(executor, "MigrationExecutor", planner)
    db.check_migrated("default")


def _newest_migration() -> str:
    """The app's leaf migration in Django's graph (the files are not numbered in order)."""
    from django.db.migrations.loader import MigrationLoader

    graph = MigrationLoader(connection).graph
    (newest,) = (name for app, name in graph.leaf_nodes() if app == "k2b_workflows")
    return newest


@pytest.mark.django_db
def test_the_newest_migration_missing_from_the_table_is_found_and_named():
    newest = _newest_migration()
    with connection.cursor() as cursor:
        # A row of another name (a migration since removed from the code) is no stand-in.
        cursor.execute(
            "UPDATE django_migrations SET name = '9999_not_a_file' "
            "WHERE app = 'k2b_workflows' AND name = %s",
            [newest],
        )
    with pytest.raises(DatabaseNotMigrated, match=newest):
        db.check_migrated("default")


@pytest.mark.django_db
def test_a_row_recorded_twice_does_not_stand_in_for_a_missing_one():
    newest = _newest_migration()
    with connection.cursor() as cursor:
        # django_migrations has no unique (app, name): a migration faked twice is two rows.
        cursor.execute(
            "INSERT INTO django_migrations (app, name, applied) "
            "SELECT app, name, applied FROM django_migrations "
            "WHERE app = 'k2b_workflows' AND name <> %s LIMIT 1",
            [newest],
        )
        cursor.execute(
            "DELETE FROM django_migrations WHERE app = 'k2b_workflows' AND name = %s", [newest]
        )
    with pytest.raises(DatabaseNotMigrated, match=newest):
        db.check_migrated("default")


@pytest.mark.django_db
def test_a_database_never_migrated_is_told_so():
    # Renamed in the test's transaction (rolled back after it): no table to read.
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE django_migrations RENAME TO django_migrations_hidden")
    with pytest.raises(DatabaseNotMigrated, match=r"manage\.py migrate"):
        db.check_migrated("default")


# -- the exit -----------------------------------------------------------------------

# Loaded by the worker's interpreter at start (PYTHONPATH): records, in the file of
# K2B_TEST_EXIT_LOG, a non-daemon thread that ends only once the main thread has, an
# atexit handler, and an object whose finalizer runs only if the modules are torn down.
SITECUSTOMIZE = """
import atexit, os, threading

_log = os.environ["K2B_TEST_EXIT_LOG"]

def _say(line):
    with open(_log, "a") as f:
        f.write(line + "\\n")

def _late():
    threading.main_thread().join()
    _say("thread")

threading.Thread(target=_late, name="late", daemon=False).start()
atexit.register(_say, "atexit")

class _Canary:
    # What it needs is bound now: by the time a teardown collects it, open() may be gone.
    def __del__(self, _fd=os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT), _w=os.write):
        _w(_fd, b"teardown\\n")

canary = _Canary()
"""


def _run_worker(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    log = tmp_path / "exit.log"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "K2B_TEST_DB_NAME": connection.settings_dict["NAME"],
        "K2B_TEST_EXIT_LOG": str(log),
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "runworkflows", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = log.read_text().split() if log.exists() else []
    return done, lines


@pytest.mark.django_db(transaction=True)
def test_a_burst_ends_as_the_interpreter_would_less_the_teardown(tmp_path):
    done, lines = _run_worker(tmp_path, "--burst", "--app", "nothing-here")
    assert done.returncode == 0, done.stderr
    assert "worker stopped" in done.stdout, done.stdout
    # Threads joined before the atexit handlers, as at any exit; no module torn down.
    assert lines == ["thread", "atexit"], (lines, done.stderr)


@pytest.mark.django_db(transaction=True)
def test_a_refused_start_keeps_its_status_and_its_message(tmp_path):
    # An argument refused by the parser: Django prints the usage and exits 2.
    done, lines = _run_worker(tmp_path, "--burst", "--concurrency", "0")
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "--concurrency: must be between 1 and 256, not 0" in done.stderr, done.stderr
    assert lines == ["thread", "atexit"], (lines, done.stderr)


@pytest.mark.django_db(transaction=True)
def test_the_topology_is_said_before_the_workers_last_line(tmp_path):
    done, _ = _run_worker(tmp_path, "--burst", "--app", "nothing-here", "--log-format", "text")
    assert done.returncode == 0, done.stderr
    said = done.stderr.find("database 'default': single node")
    stopped = done.stderr.find(" stopped: ")
    assert 0 <= said < stopped, done.stderr
