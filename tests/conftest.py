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
from collections.abc import Callable, Iterator
from pathlib import Path

import pgtrigger
import pytest
from django.db.backends.postgresql.operations import DatabaseOperations

ROOT = Path(__file__).resolve().parent.parent

#: The database refuses TRUNCATE of the append-only tables (#9), and Django's
#: test teardown empties tables with TRUNCATE: only that flush steps past it.
_NO_TRUNCATE = (
    "k2b_workflows.JournalEntry:journal_no_truncate",
    "k2b_workflows.LedgerEntry:ledger_no_truncate",
    "k2b_workflows.BudgetCharge:charge_no_truncate",
)
_execute_sql_flush = DatabaseOperations.execute_sql_flush


def _flush_past_the_truncate_guard(self: DatabaseOperations, sql_list: list[str]) -> None:
    with pgtrigger.ignore(*_NO_TRUNCATE, databases=[self.connection.alias]):
        _execute_sql_flush(self, sql_list)


DatabaseOperations.execute_sql_flush = _flush_past_the_truncate_guard  # type: ignore[method-assign]


def wait_for(
    predicate: Callable[[], object],
    timeout: float = 20.0,
    interval: float = 0.05,
    message: str = "condition",
) -> object:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {message}")
        time.sleep(interval)


class WorkerProcess:
    """A ``manage.py runworkflows`` subprocess on the test database."""

    def __init__(self, db_name: str, env: dict[str, str], args: list[str]) -> None:
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
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "runworkflows", *args],
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
        """Every thread's Python stack, read from outside by py-spy (a dev dependency)."""
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

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


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
