"""Worker subprocesses and waiting on conditions: what most tests of real processes share.

A test that kills a worker must read its log when a wait fails, on a machine
too loaded to say when: ``wait_for`` polls a condition with a generous
timeout and reports what there was at the timeout; ``WorkerProcess`` starts
``manage.py runworkflows`` on the test database and can always say whether
the worker runs, what its threads do and what it logged.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from django.core.management import call_command

from tests.support import forkserver

#: The repository: where ``manage.py`` is.
ROOT = Path(__file__).resolve().parents[2]

#: For a test that needs the server's own view of its connection (a backend pid to
#: end, the server's commit and connection counts): ``make test-pgbouncer`` skips it.
direct_connection_only = pytest.mark.skipif(
    bool(os.environ.get("K2B_TEST_POOL_MODE")),
    reason="needs a direct connection: through PgBouncer the backend pid and the "
    "server's connections are the pooler's",
)


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


def workflowstatus(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    try:
        call_command("workflowstatus", *args, stdout=out, stderr=err)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()
