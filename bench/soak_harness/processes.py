"""The soak's processes: ``runworkflows`` workers, and the CPU burners that starve them.

The failure the burners are built around: a starvation soak that outlives its
run. A burner spins in a session of its own (so ``os.killpg`` ends it and
anything it started), exits by itself at its deadline, and exits as soon as its
parent is gone, so that a harness SIGKILLed mid-run leaves no busy loop on a
shared machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Runs ``manage.py`` and notes, before the interpreter tears down, that it ended by
#: itself: a worker that is SIGKILLed while already exiting still counts as dead on its own.
LAUNCH = """
import os, runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except BaseException as exc:
    with open(os.environ["K2B_SOAK_EXIT_FILE"], "w") as f:
        f.write(f"{type(exc).__name__}: {exc}")
    raise
with open(os.environ["K2B_SOAK_EXIT_FILE"], "w") as f:
    f.write("returned")
"""


MANAGE = ("manage.py", "runworkflows")


class Worker:
    """One ``runworkflows`` process; its output goes to a log file of its own."""

    def __init__(
        self,
        slot: int,
        serial: int,
        env: dict[str, str],
        args: list[str],
        logs: Path,
        nice: int = 0,
    ):
        self.slot = slot
        self.log_path = logs / f"worker-{slot}-{serial}.log"
        self.exit_path = logs / f"worker-{slot}-{serial}.exit"
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            # Niced, a worker gets less of a starved CPU than a burner does.
            ["nice", "-n", str(nice), sys.executable, "-c", LAUNCH, *MANAGE, *args],
            cwd=ROOT,
            env={**env, "K2B_SOAK_EXIT_FILE": str(self.exit_path)},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.killed = False  # SIGKILLed by the chaos loop: its exit is expected
        self.thaw_at: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int = 12) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()


#: A busy loop that ends at its deadline or when its parent goes away.
BURN = """
import os, sys, time
parent, deadline = os.getppid(), time.monotonic() + float(sys.argv[1])
while os.getppid() == parent and time.monotonic() < deadline:
    for _ in range(200_000):
        pass
"""


#: Burners yield to everything else on the machine at niceness 0 (a shared machine's
#: other work, the soak's own database and harness), and starve workers niced below them.
BURNER_NICE = 5


class Burners:
    """``count`` busy processes, each in a session of its own, for at most ``seconds``."""

    def __init__(self, count: int, seconds: float) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.count, self.seconds = count, seconds
        self.started_at: float | None = None
        self.stopped_at: float | None = None

    def start(self) -> None:
        self.started_at = time.monotonic()
        for _ in range(self.count):
            self.procs.append(
                subprocess.Popen(
                    ["nice", "-n", str(BURNER_NICE), sys.executable, "-c", BURN, str(self.seconds)],
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                )
            )

    def stop(self) -> None:
        """Kill every burner's process group; safe to call twice, and on burners never started."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        if self.procs and self.stopped_at is None:
            self.stopped_at = time.monotonic()
        self.procs = []

    @property
    def busy_seconds(self) -> float:
        if self.started_at is None or not self.count:
            return 0.0
        return (self.stopped_at or time.monotonic()) - self.started_at
