"""The fork server starts processes that behave as ``python manage.py ...`` would.

The crash tests read exit statuses (``-SIGKILL``), send signals and read
output of worker processes that ``tests/support/forkserver.py`` forks: these are the
parts of ``subprocess`` they rely on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import forkserver
from tests.support.processes import ROOT, wait_for

pytestmark = pytest.mark.skipif(not forkserver.enabled(), reason="K2B_TEST_FORK=0")

SCRIPT = """
import os, signal, sys, threading, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "pid", os.getpid(), flush=True)
print("env", os.environ.get("K2B_PROBE"), "settings", os.environ.get("DJANGO_SETTINGS_MODULE"))
print("stdin", repr(sys.stdin.read()))
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "raise":
    raise RuntimeError("boom")
if mode == "thread":
    # Interpreter shutdown joins non-daemon threads, as in any Python process.
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
if mode == "wait":
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(3)))
    while True:
        time.sleep(0.05)
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


def spawn(script: Path, tmp_path: Path, *args: str):
    log = open(tmp_path / f"probe-{'-'.join(args)}.log", "w")  # noqa: SIM115
    proc = forkserver.popen(
        [sys.executable, str(script), *args],
        env={"K2B_PROBE": "yes", "PATH": os.environ.get("PATH", "")},
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    assert isinstance(proc, forkserver.ForkedProcess)
    return proc, Path(log.name)


def test_exit_status_output_environment_and_directory_are_the_childs_own(script, tmp_path):
    proc, log = spawn(script, tmp_path, "exit", "7")
    assert proc.wait(timeout=30) == 7
    out = log.read_text()
    assert f"argv ['exit', '7'] cwd {tmp_path} pid {proc.pid}" in out
    assert "env yes settings None" in out  # the suite's DJANGO_SETTINGS_MODULE is not inherited
    assert "stdin ''" in out


def test_an_exception_exits_1_with_its_traceback_and_threads_are_joined(script, tmp_path):
    proc, log = spawn(script, tmp_path, "raise")
    assert proc.wait(timeout=30) == 1
    assert "RuntimeError: boom" in log.read_text()
    proc, log = spawn(script, tmp_path, "thread")
    assert proc.wait(timeout=30) == 0
    assert "thread joined" in log.read_text()


def test_signals_reach_the_child_and_a_kill_reads_as_minus_sigkill(script, tmp_path):
    proc, log = spawn(script, tmp_path, "wait")
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    assert proc.poll() is None
    wait_for(lambda: "pid" in log.read_text(), message="the child to start")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 3
    assert "got SIGTERM" in log.read_text()

    proc, log = spawn(script, tmp_path, "wait")
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_run_captures_output_and_raises_on_timeout(tmp_path):
    result = forkserver.run(
        [sys.executable, str(ROOT / "manage.py"), "help", "runworkflows"],
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"},
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    assert "--concurrency" in result.stdout
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        forkserver.run([sys.executable, str(script)], env={}, cwd=tmp_path, timeout=0.5, check=True)
