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
    """``pool_mode`` transaction or session; ``users``: roles to admit besides postgres and
    app; ``settings``: more ``[pgbouncer]`` lines."""

    def __init__(
        self,
        server_host: str,
        server_port: int,
        mode: str,
        user: str | None,
        users: tuple[str, ...] = (),
        **settings: object,
    ) -> None:
        self.binary = require()
        self.mode = mode
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="k2bbouncer-"))
        os.chmod(self.root, 0o755)
        self.log = self.root / "pgbouncer.log"
        # Trust still wants each user listed; ``users``: more of them (a test's roles).
        listed = ("postgres", "app", *users)
        (self.root / "users.txt").write_text("".join(f'"{name}" ""\n' for name in listed))
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


def main(argv: list[str]) -> int:
    """``python -m tests.support.pgbouncer MODE -- COMMAND...``: COMMAND with DATABASE_URL through a
    PgBouncer of its own in MODE (transaction or session) in front of DATABASE_URL's server.

    In transaction mode COMMAND also gets the documented settings: the direct URL
    for the listener (``K2B_TEST_DIRECT_URL``, the alias "direct" in tests/settings.py),
    nothing prepared (``K2B_TEST_PREPARE=0``: PgBouncer before 1.21), and the role's
    ``idle_in_transaction_session_timeout`` in each test database
    (``K2B_TEST_POOL_MODE``: tests/conftest.py sets it). ``make test-pgbouncer`` runs
    the crash, waits and hot-path tests so.
    """
    import sys

    from psycopg.conninfo import conninfo_to_dict

    if len(argv) < 3 or argv[0] not in ("transaction", "session") or argv[1] != "--":
        print(
            "usage: python -m tests.support.pgbouncer transaction|session -- COMMAND...",
            file=sys.stderr,
        )
        return 2
    mode, command = argv[0], argv[2:]
    direct = os.environ["DATABASE_URL"]
    info = conninfo_to_dict(direct)
    user = None
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        user = "embedded_postgres"  # tests/conftest.py makes sure it exists
    bouncer = Bouncer(
        info.get("host") or "/var/run/postgresql",
        int(info.get("port") or 5432),
        mode,
        user,
        admin_users="postgres",
    )
    env = {
        **os.environ,
        "DATABASE_URL": bouncer.url(
            info.get("dbname") or "postgres", info.get("user") or "postgres"
        ),
        "K2B_TEST_POOL_MODE": mode,
        "K2B_TEST_BOUNCER_PORT": str(bouncer.port),
    }
    if mode == "transaction":
        env.update(K2B_TEST_DIRECT_URL=direct, K2B_TEST_PREPARE="0")
    print(f"pgbouncer {version_text()} ({mode} mode) on 127.0.0.1:{bouncer.port}", file=sys.stderr)
    try:
        return subprocess.run(command, env=env).returncode
    finally:
        bouncer.stop()


def version_text() -> str:
    return ".".join(map(str, version()))


def reconnect(port: int) -> None:
    """Make PgBouncer replace its server connections (after a role setting changed)."""
    admin(port, "RECONNECT")


def admin(port: int, command: str) -> None:
    """One command on PgBouncer's admin console."""
    import psycopg

    with psycopg.connect(
        f"postgresql://postgres@127.0.0.1:{port}/pgbouncer?sslmode=disable", autocommit=True
    ) as conn:
        # The admin console speaks only the simple query protocol.
        conn.pgconn.exec_(command.encode())


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
