"""SIGTERM/SIGINT reach the worker through a watcher thread, never a signal handler.

A handler runs inside whatever the main thread was doing: if that holds a lock the
handler needs (an Event's, stderr's), the handler deadlocks or raises, and the stop
is lost. These run a small process whose main thread holds such a lock nearly all
the time, and signal it for real.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.processes import ROOT, wait_for

pytestmark = pytest.mark.crash

CHILD = textwrap.dedent(
    """
    import sys, threading, time
    from k2b_workflows.worker.stop_signals import stop_signals

    # The main thread holds this lock almost all the time, as the worker's main
    # thread holds an Event's or a logging handler's lock while it waits or logs.
    lock = threading.Lock()
    stopping = threading.Event()
    received = []

    def on_signal(signum):
        with lock:  # as worker.stop() takes its Events' locks
            received.append(signum)
            sys.stderr.write(f"received {signum}\\n")
        stopping.set()

    with stop_signals(on_signal):
        print("ready", flush=True)
        while not stopping.is_set():
            with lock:
                began = time.monotonic()
                while time.monotonic() - began < 0.05:
                    sys.stderr.write("working\\n")
            # A millisecond out of every 51 without the lock: a Lock is not fair,
            # and a main thread that takes it back at once starved the watcher's
            # callback for tens of seconds. A handler run in this thread would still
            # find the lock held, nearly always, by the thread it interrupted.
            time.sleep(0.001)
    print("stopped", received, flush=True)
    """
)


def start_child(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "out.txt"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        cwd=ROOT,
        stdout=out.open("w"),
        stderr=(tmp_path / "err.txt").open("w"),
    )
    wait_for(lambda: "ready" in out.read_text(), timeout=60, message="the child to start")
    return proc, out


def stopped_state(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_a_main_thread_that_holds_the_lock_the_callback_needs(tmp_path, signum):
    for _ in range(5):
        proc, out = start_child(tmp_path)
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == 0, (tmp_path / "err.txt").read_text()[-2000:]
        assert f"stopped [{int(signum)}]" in out.read_text()


def test_a_freeze_and_thaw_is_not_taken_for_a_signal(tmp_path):
    """SIGSTOP/SIGCONT interrupting the watcher's wait past its timeout makes CPython
    return a siginfo of garbage; the watcher must not act on it."""
    proc, out = start_child(tmp_path)
    proc.send_signal(signal.SIGSTOP)
    wait_for(lambda: stopped_state(proc.pid), timeout=60, message="the child to stop")
    frozen_at = time.monotonic()
    # Stay stopped past the watcher's poll (0.1 s) so its wait times out while frozen.
    wait_for(lambda: time.monotonic() - frozen_at > 0.5, message="half a second")
    proc.send_signal(signal.SIGCONT)
    wait_for(lambda: not stopped_state(proc.pid), timeout=60, message="the child to thaw")
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    errors = (tmp_path / "err.txt").read_text()
    assert "Traceback" not in errors and "failed" not in errors, errors[-2000:]
    assert f"stopped [{int(signal.SIGTERM)}]" in out.read_text()
