"""A PgBouncer a test owns, on a loopback port of its own, in front of a cluster it names.

Debian's ``pgbouncer`` package (``.ci/run`` installs it); without the binary the
tests that need it skip, saying so. It runs as the embedded PostgreSQL's user
when the suite runs as root (PgBouncer refuses root).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

# Debian installs it in /usr/sbin, which a non-root PATH may lack.
BINARY = shutil.which("pgbouncer", path=f"{os.environ.get('PATH', '')}:/usr/sbin")


def require() -> str:
    """The pgbouncer binary, or skip the test with the reason."""
    if BINARY is None:
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer; .ci/run does it)")
    return BINARY


def version() -> tuple[int, ...]:
    out = subprocess.run([require(), "--version"], capture_output=True, text=True).stdout
    return tuple(int(p) for p in out.split()[1].split("."))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Bouncer:
    """``pool_mode`` transaction or session; ``settings``: more ``[pgbouncer]`` lines."""

    def __init__(
        self, server_host: str, server_port: int, mode: str, user: str | None, **settings: object
    ) -> None:
        self.binary = require()
        self.mode = mode
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="k2bbouncer-"))
        os.chmod(self.root, 0o755)
        self.log = self.root / "pgbouncer.log"
        (self.root / "users.txt").write_text('"postgres" ""\n"app" ""\n')
        lines = {
            "listen_addr": "127.0.0.1",
            "listen_port": self.port,
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": self.root / "users.txt",
            "pool_mode": mode,
            "max_client_conn": 400,
            "default_pool_size": 20,
            "server_login_retry": 1,
            "logfile": self.log,
            "pidfile": self.root / "pgbouncer.pid",
            **settings,
        }
        config = (
            f"[databases]\n* = host={server_host} port={server_port}\n\n[pgbouncer]\n"
            + "".join(f"{key} = {value}\n" for key, value in lines.items())
        )
        (self.root / "pgbouncer.ini").write_text(config)
        self.user = user
        if user:
            entry = pwd.getpwnam(user)
            for path in (self.root, *self.root.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self.proc = subprocess.Popen(
            [self.binary, str(self.root / "pgbouncer.ini")],
            user=user,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pgbouncer did not start:\n{self.output()}") from None
                time.sleep(0.05)

    def url(self, database: str, user: str = "postgres", **options: object) -> str:
        query = "".join(f"&{key}={value}" for key, value in options.items())
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}?sslmode=disable{query}"

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)
