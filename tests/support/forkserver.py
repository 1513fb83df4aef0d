"""Start ``manage.py`` processes by forking a process that has imported Django already.

A worker subprocess spent ~0.4 s of CPU importing Django, psycopg and
pgtrigger before it did anything, and the suite starts about a hundred of
them (crash tests, scripts on self-started clusters). The fork server
imports those libraries once, with no settings (nothing is configured,
connected or threaded before a fork), and forks one child per process. The
child then does what ``python manage.py ...`` does: it reads its settings
from its own environment, sets Django up, runs the command and exits as an
interpreter does (atexit handlers, non-daemon threads joined, exit status).

``spawn`` returns a ``Popen``-like handle (pid, poll, wait, send_signal,
kill, returncode negative for a signal) whose exit status the server reports
as soon as it reaps the child. ``K2B_TEST_FORK=0`` starts every process with
``subprocess`` instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

#: Imported before forking: what every ``manage.py`` process of the suite imports
#: anyway and that needs no settings. Settings, apps and models come after the fork.
PRELOAD = (
    "django.core.management",
    "django.core.checks",
    "django.db.models",
    "django.db.backends.postgresql.base",
    "django.contrib.admin",
    "django.contrib.admin.views.main",
    "django.contrib.staticfiles",
    "django.contrib.messages",
    "django.forms",
    "django.template.defaulttags",
    "django.views.generic",
    "psycopg",
    "pgtrigger",
    "environ",
)


def enabled() -> bool:
    return os.environ.get("K2B_TEST_FORK", "1") != "0"


# -- the server process ---------------------------------------------------------


def _write(message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(1, data) :]


def _serve() -> dict[str, Any]:
    """Fork a child per request line on stdin; return (in the child only) its request."""
    for name in PRELOAD:
        with contextlib.suppress(Exception):
            __import__(name)
    assert threading.active_count() == 1, "a preloaded module started a thread"
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    # A handler (not SIG_DFL) so that SIGCHLD reaches the wakeup fd.
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                _write({"exited": pid, "status": status})
        if 0 in readable:
            chunk = os.read(0, 65536)
            if not chunk:
                os._exit(0)  # the suite has gone: its children are on their own
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    return request
                _write({"id": request["id"], "pid": pid})


def _become(request: dict[str, Any]) -> None:
    """In the forked child: take the request's files, directory, environment and argv."""
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    err = out
    if request["stderr"] != request["stdout"]:
        err = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    sys.path[0] = str(Path(request["argv"][0]).resolve().parent)


def main() -> None:
    request = _serve()
    _become(request)
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")


# -- the suite's side -------------------------------------------------------------


class ForkedProcess:
    """What the suite uses of ``subprocess.Popen``, for a child of the fork server."""

    def __init__(self, server: ForkServer, args: list[str], pid: int) -> None:
        self._server = server
        self.args = args
        self.pid = pid
        self.returncode: int | None = None

    def _exited(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._server.changed:
            if not self._server.changed.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_")}
        env["PYTHONUNBUFFERED"] = "1"  # read at start-up: the children's output is not buffered
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=Path(__file__).resolve().parents[2],
        )
        self.changed = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}
        self._started: dict[int, int] = {}
        self._ids = 0
        self._send = threading.Lock()
        threading.Thread(target=self._read, name="k2b-forkserver", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.changed:
                if "exited" in message:
                    child = self._children.pop(message["exited"], None)
                    if child is None:
                        self._early[message["exited"]] = message["status"]
                    else:
                        child._exited(message["status"])
                else:
                    self._started[message["id"]] = message["pid"]
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(
        self, args: list[str], *, env: dict[str, str], cwd: Path, stdout: Path, stderr: Path
    ) -> ForkedProcess:
        assert self.proc.stdin is not None
        with self._send:
            self._ids += 1
            request_id = self._ids
            request = {
                "id": request_id,
                "argv": args[1:],
                "env": env,
                "cwd": str(cwd),
                "stdout": str(stdout),
                "stderr": str(stderr),
            }
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        with self.changed:
            if not self.changed.wait_for(
                lambda: request_id in self._started or not self.alive(), timeout=60
            ):
                raise RuntimeError("the fork server did not start the process")
            if request_id not in self._started:
                raise RuntimeError("the fork server has exited")
            pid = self._started.pop(request_id)
            child = ForkedProcess(self, args, pid)
            if pid in self._early:
                child._exited(self._early.pop(pid))
            else:
                self._children[pid] = child
        return child


_server: ForkServer | None = None
_server_lock = threading.Lock()


def server() -> ForkServer:
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            _server = ForkServer()
        return _server


def popen(
    args: list[str], *, env: dict[str, str], cwd: Path, stdout: Any, stderr: Any = None
) -> Any:
    """``subprocess.Popen(args, env=..., cwd=..., stdout=file, stderr=file or STDOUT)``.

    ``args`` is ``[sys.executable, script, *arguments]``; ``stdout`` an open file.
    """
    if not enabled() or args[0] != sys.executable:
        return subprocess.Popen(args, cwd=cwd, env=env, stdout=stdout, stderr=stderr)
    out = Path(stdout.name)
    err = out if stderr in (None, subprocess.STDOUT) else Path(stderr.name)
    return server().spawn(args, env=env, cwd=cwd, stdout=out, stderr=err)


def run(
    args: list[str], *, env: dict[str, str], cwd: Path, timeout: float, check: bool
) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, ...)`` through the fork server."""
    if not enabled() or args[0] != sys.executable:
        return subprocess.run(
            args, cwd=cwd, env=env, capture_output=True, text=True, check=check, timeout=timeout
        )
    with (
        tempfile.NamedTemporaryFile("w+", prefix="k2b-out-") as out,
        tempfile.NamedTemporaryFile("w+", prefix="k2b-err-") as err,
    ):
        child = server().spawn(args, env=env, cwd=cwd, stdout=Path(out.name), stderr=Path(err.name))
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
        result = subprocess.CompletedProcess(
            args, child.returncode or 0, Path(out.name).read_text(), Path(err.name).read_text()
        )
    if check:
        result.check_returncode()
    return result


if __name__ == "__main__":
    main()
