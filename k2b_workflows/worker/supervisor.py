"""``runworkflows --processes N``: one process imports Django once and keeps N worker processes.

The Python of one worker is its limit (the GIL), so a machine with several
cores needs several worker processes; the failures a supervisor of them must
survive are:

- **a child dies** (SIGKILL, the OOM killer, a segfault in an extension): its
  runs are taken over when their leases expire, as after any crash; the
  supervisor forks a new child at once, and with a growing delay if children
  keep dying young, so that a crash at start-up does not spin the CPU;
- **a child cannot start** for a configuration error (an unmigrated database,
  a wrong database name or password): starting it again cannot help, so the
  child exits with ``EXIT_CONFIG`` and the supervisor stops the whole group
  and exits 2, as a single ``runworkflows`` does; a child whose
  ``--wait-for-db`` ran out exits ``EXIT_UNAVAILABLE`` and the group exits 1;
- **SIGTERM/SIGINT** reach the supervisor: it sends SIGTERM to every child,
  each stops after its current steps (an external call in flight is waited
  for until it returns, however long) and hands its runs back (a second
  signal is forwarded too, as one more SIGTERM: each child hands back at
  once, cutting its calls), and the supervisor exits when every child has
  ended. Each child is in a process group of its
  own, so a terminal's Ctrl-C reaches it once, through the supervisor, and
  is not counted twice;
- **the supervisor is SIGKILLed**: nobody forwards anything, so each child
  asks the kernel for a SIGTERM when its parent dies (``PR_SET_PDEATHSIG``,
  Linux); where that is not available, a thread of the child notices that
  its parent pid changed and sends it the same SIGTERM, and a child whose
  parent died before it could ask exits at once. Exactly one SIGTERM either
  way, so each child stops as after an operator's one SIGTERM: its external
  calls in flight return, other steps finish within the grace period (two,
  from both sources, forced an exit mid-step and left every EXTERNAL step in
  flight in doubt). No child outlives the group by more than the grace
  period or its longest external call in flight.

The supervisor forks after ``django.setup()``, with no database connection
open and no thread started (a fork copies only the forking thread; a lock
another thread held would stay locked in the child). Its loop is one thread:
it waits in ``select`` on the signal wake-up pipe (the signals are only
noted there), the metrics socket and a timer.

The group's ``--health-file``: each child touches a file of its own in a
private directory; the supervisor sets the group's file to the time of the
*least* recently healthy child, so ``workerhealth PATH --max-age S`` is
healthy only while every child is. The group's ``--metrics-port``: children
count in ``prometheus_client``'s multiprocess mode (files in a private
directory); the supervisor serves their sum, and the database gauges, on one
port from its own loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..kernel import weather
from . import exits

logger = logging.getLogger("k2b_workflows")

#: A child could not start for a reason a restart cannot fix (sysexits.h ``EX_CONFIG``).
EXIT_CONFIG = 78
#: A child's ``--wait-for-db`` ran out before the database answered (``EX_UNAVAILABLE``).
EXIT_UNAVAILABLE = 69
#: A child that lived at least this long before it died is restarted at once.
HEALTHY_LIFETIME_S = 10.0
#: How often the loop looks at the children's health files and parent pids are checked.
TICK_S = 0.5
#: ``prctl`` option: the signal the kernel sends this process when its parent dies.
_PR_SET_PDEATHSIG = 1

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: What a worker imports before its first claim that ``django.setup()`` has not:
#: imported by the supervisor before it forks (no thread starts on import).
#: ``prometheus_client`` after ``PROMETHEUS_MULTIPROC_DIR`` is set (``_prepare``).
PRELOAD = ("prometheus_client", "k2b_workflows.worker.topology")


@dataclass
class Slot:
    """One of the N places in the group; a child is forked into it, again after a death."""

    index: int
    pid: int | None = None
    started: float = 0.0
    restart_at: float | None = None
    starts: int = 0
    done: bool = False
    backoff: weather.Backoff = field(default_factory=lambda: weather.Backoff(first=0.5, cap=30.0))


class Supervisor:
    """Forks ``processes`` children that each call ``run_child(index, health_path)``.

    ``run_child`` returns the child's exit status (``EXIT_CONFIG`` and
    ``EXIT_UNAVAILABLE`` stop the group). ``burst``: a child that exits 0 has
    drained the queue and is not restarted; the supervisor exits when all have.
    """

    def __init__(
        self,
        *,
        processes: int,
        run_child: Callable[[int, str | None], int],
        burst: bool = False,
        health_file: str | None = None,
        metrics_port: int | None = None,
        using: str | None = None,
    ) -> None:
        self.slots = [Slot(i) for i in range(processes)]
        self.run_child = run_child
        self.burst = burst
        self.health_file = Path(health_file) if health_file else None
        self.metrics_port = metrics_port
        self.using = using
        self.stops = 0
        #: The exit status the group ends with once every child has ended.
        self.exit_code = 0
        self._pid = os.getpid()
        self._wake_r = self._wake_w = -1
        self._private: list[str] = []
        self._health_dir: Path | None = None
        self._metrics_dir: str | None = None
        self._metrics_server: Any = None
        self.metrics_bound: int | None = None

    # -- the loop ------------------------------------------------------------

    def run(self) -> int:
        """Start every child, keep them until the group ends; returns the exit status."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        previous_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        # Handlers that do nothing: the signal's number is written to the wake-up pipe,
        # and the loop acts on it in ordinary code (no lock or I/O inside a handler).
        handled = (*STOP_SIGNALS, signal.SIGCHLD)
        previous = {sig: signal.signal(sig, _noted) for sig in handled}
        previous_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
        try:
            self._prepare()
            for slot in self.slots:
                self._fork(slot)
            while True:
                self._reap()
                if not self._live() and not self._restarts_pending():
                    break
                self._start_due()
                self._aggregate_health()
                self._wait()
                self._read_signals()
            self.say(f"all {len(self.slots)} worker process(es) ended")
        finally:
            signal.set_wakeup_fd(previous_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
            self._clean_up()
        return self.exit_code

    def _live(self) -> bool:
        return any(slot.pid is not None for slot in self.slots)

    def _restarts_pending(self) -> bool:
        return any(slot.restart_at is not None for slot in self.slots)

    def _wait(self) -> None:
        timeout = TICK_S
        now = time.monotonic()
        for slot in self.slots:
            if slot.restart_at is not None:
                timeout = min(timeout, max(slot.restart_at - now, 0.0))
        readable = [self._wake_r]
        if self._metrics_server is not None:
            readable.append(self._metrics_server.fileno())
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select(readable, [], [], timeout)
            if self._metrics_server is not None and self._metrics_server.fileno() in ready:
                self._serve_scrape()

    def _read_signals(self) -> None:
        while True:
            try:
                data = os.read(self._wake_r, 512)
            except BlockingIOError:
                return
            if not data:
                return
            for signum in data:
                if signum in STOP_SIGNALS:
                    self._on_stop(signum)

    def _on_stop(self, signum: int) -> None:
        self.stops += 1
        name = signal.Signals(signum).name
        for slot in self.slots:
            slot.restart_at = None
        if self.stops == 1:
            self.say(f"received {name}: stopping every worker process after its current steps")
        else:
            self.say(f"received {name} again: every worker process hands its runs back now")
        self._signal_children(signal.SIGTERM)

    def _signal_children(self, sig: int) -> None:
        for slot in self.slots:
            if slot.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.pid, sig)

    # -- children ------------------------------------------------------------

    def _fork(self, slot: Slot) -> None:
        from django.db import connections

        # A child must not share a connection's socket with its parent: two
        # processes writing one protocol stream corrupt it for both.
        connections.close_all()
        sys.stdout.flush()
        sys.stderr.flush()
        slot.restart_at = None
        slot.starts += 1
        # Held back across the fork: a signal for the child before it has reset its
        # handlers would be written to the supervisor's wake-up pipe, and read as its own.
        handled = (*STOP_SIGNALS, signal.SIGCHLD)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, handled)
        pid = os.fork()
        if pid == 0:
            self._child(slot)  # never returns
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        slot.pid = pid
        slot.started = time.monotonic()
        self.say(f"worker process {slot.index} started (pid {pid})")

    def _child(self, slot: Slot) -> None:
        code = 1
        try:
            self._become_child()
            health = str(self._health_dir / str(slot.index)) if self._health_dir else None
            code = self.run_child(slot.index, health)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            # Never return into the supervisor's frames (its clean-up would run here).
            with contextlib.suppress(BaseException):
                # Threads a step left behind are not waited for: the grace period has.
                exits.exit_hooks(join_threads=False)
            os._exit(code)

    def _become_child(self) -> None:
        signal.set_wakeup_fd(-1)
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._metrics_server is not None:
            self._metrics_server.socket.close()
        for sig in (*STOP_SIGNALS, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (*STOP_SIGNALS, signal.SIGCHLD))
        # Ctrl-C on a terminal signals the whole foreground group: in a group of
        # its own the child hears it once, forwarded, not twice (which forces).
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        kernel_signals = set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != self._pid:
            # The supervisor died before the request above: nobody will stop us.
            os._exit(0)
        if not kernel_signals:
            # One SIGTERM per parent death, from the kernel or else from this
            # thread, never both: a second SIGTERM means "hand back at once", and
            # every step in flight would end in doubt instead of finishing (#38).
            ParentWatch(self._pid).start()
        if self._metrics_dir is not None:
            _multiprocess_values()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            for slot in self.slots:
                if slot.pid == pid:
                    self._ended(slot, os.waitstatus_to_exitcode(status))
                    break

    def _ended(self, slot: Slot, code: int) -> None:
        pid, slot.pid = slot.pid, None
        lived = time.monotonic() - slot.started
        self._forget_child(slot, pid)
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited {code}"
        if code in (EXIT_CONFIG, EXIT_UNAVAILABLE):
            slot.done = True
            if self.exit_code == 0:
                self.exit_code = 2 if code == EXIT_CONFIG else 1
                why = "a configuration error" if code == EXIT_CONFIG else "no database"
                self.say(
                    f"worker process {slot.index} (pid {pid}) {how}: {why}; stopping the group"
                )
                self._stop_group()
            return
        if self.stops or self.exit_code:
            slot.done = True
            self.say(f"worker process {slot.index} (pid {pid}) {how}")
            return
        if self.burst and code == 0:
            slot.done = True
            self.say(f"worker process {slot.index} (pid {pid}) drained the queue")
            return
        if lived >= HEALTHY_LIFETIME_S:
            slot.backoff.reset()
            delay = 0.0
        else:
            delay = slot.backoff.next()
        slot.restart_at = time.monotonic() + delay
        self.say(
            f"worker process {slot.index} (pid {pid}) {how} after {lived:.1f} s;"
            f" restarting it in {delay:.1f} s"
        )

    def _stop_group(self) -> None:
        for slot in self.slots:
            slot.restart_at = None
        self._signal_children(signal.SIGTERM)

    def _start_due(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.restart_at is not None and slot.restart_at <= now:
                self._fork(slot)

    def _forget_child(self, slot: Slot, pid: int | None) -> None:
        """A dead child's health file would say it was healthy a moment ago: remove it."""
        if self._health_dir is not None:
            (self._health_dir / str(slot.index)).unlink(missing_ok=True)
        if self._metrics_dir is not None and pid is not None:
            from prometheus_client import multiprocess

            with contextlib.suppress(Exception):
                multiprocess.mark_process_dead(pid, self._metrics_dir)

    # -- health and metrics of the group ----------------------------------------

    def _prepare(self) -> None:
        if self.health_file is not None:
            self._health_dir = Path(self._private_dir("k2b-health-"))
        if self.metrics_port is not None:
            # Before prometheus_client is imported here or in a child: it picks its
            # value class (per process or in files) from this variable.
            self._metrics_dir = self._private_dir("k2b-metrics-")
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = self._metrics_dir
            self._metrics_server = _scrape_server(self.metrics_port, self._metrics_dir, self.using)
            self.metrics_bound = int(self._metrics_server.server_port)
            self.say(f"metrics of the group on port {self.metrics_bound}")
        # Once here rather than in every child, each on a core the others need then.
        for name in PRELOAD:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)

    def _private_dir(self, prefix: str) -> str:
        path = tempfile.mkdtemp(prefix=prefix)
        self._private.append(path)
        return path

    def _aggregate_health(self) -> None:
        if self.health_file is None or self._health_dir is None:
            return
        times = []
        for slot in self.slots:
            if slot.done:
                continue
            try:
                times.append((self._health_dir / str(slot.index)).stat().st_mtime)
            except FileNotFoundError:
                return  # a child not (yet, or no longer) healthy: the group's file ages
        if not times:
            return
        oldest = min(times)
        try:
            if self.health_file.stat().st_mtime >= oldest:
                return
        except FileNotFoundError:
            self.health_file.touch()
        os.utime(self.health_file, (oldest, oldest))

    def _serve_scrape(self) -> None:
        try:
            self._metrics_server.handle_request()
        except Exception:
            logger.exception("metrics: a scrape failed")

    def _clean_up(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.server_close()
        if self.health_file is not None:
            self.health_file.unlink(missing_ok=True)
        for path in self._private:
            shutil.rmtree(path, ignore_errors=True)
        if self._metrics_dir is not None and os.environ.get("PROMETHEUS_MULTIPROC_DIR") == (
            self._metrics_dir
        ):
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def say(self, line: str) -> None:
        logger.info("supervisor %d: %s", self._pid, line)


def _noted(signum: int, frame: object) -> None:
    """The signal's number is in the wake-up pipe already; the loop acts on it."""


class ParentWatch(threading.Thread):
    """In a child: SIGTERM itself once its parent is gone, where PR_SET_PDEATHSIG is missing.

    Started only there: beside the kernel's signal it would be a second SIGTERM,
    which forces the worker out mid-step."""

    def __init__(self, parent: int) -> None:
        super().__init__(name="k2b-parent-watch", daemon=True)
        self.parent = parent

    def run(self) -> None:
        # The stop signals go to the worker's signal thread, never to this one.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        while os.getppid() == self.parent:
            time.sleep(TICK_S)
        logger.warning("worker %d: the supervisor %d is gone; stopping", os.getpid(), self.parent)
        os.kill(os.getpid(), signal.SIGTERM)


def set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _multiprocess_values() -> None:
    """In a child: count in the group's files even if prometheus_client was imported already."""
    if "prometheus_client.values" in sys.modules:
        from prometheus_client import values

        values.ValueClass = values.get_value_class()


def _scrape_server(port: int, path: str, using: str | None) -> Any:
    """An HTTP server for the group's metrics, served one request at a time from the loop."""
    from http.server import HTTPServer

    from prometheus_client import CollectorRegistry, multiprocess
    from prometheus_client.exposition import MetricsHandler

    from ..metrics import DatabaseCollector

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)
    registry.register(DatabaseCollector(using))
    handler = MetricsHandler.factory(registry)
    # A scraper that connects and sends nothing must not hold the loop for long.
    handler.timeout = 5  # type: ignore[attr-defined]

    class Server(HTTPServer):
        address_family = socket.AF_INET
        allow_reuse_address = True

    return Server(("0.0.0.0", port), handler)
