"""The kernel's clock cannot be moved from a runtime-role session (#35).

``k2b_now()`` used to add the session setting ``k2b.clock_offset``, which any
session may set: as the runtime role a day ahead directly, and through a
PgBouncer in transaction mode on a pooled server connection that the workers
then got, so that tomorrow's tick fired today and ``finished_at`` was written
a day ahead. Now ``k2b_now()`` reads no setting; the offset-honouring body is
installed by the owner only while a test's ``controlled_clock()`` runs.
"""

from __future__ import annotations

import datetime as dt
import os

import psycopg
import pytest
from django.db import DatabaseError, connection, connections

from k2b_workflows.kernel import clock, db
from k2b_workflows.testing import controlled_clock
from tests.support import pgbouncer, runtime_role
from tests.support.runtime_role import RUNTIME

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", RUNTIME])

runtime = runtime_role.runtime

DAY = "86400 seconds"
OFFSET_SQL = "SELECT k2b_now() - statement_timestamp()"


def offset_after_setting(conn) -> dt.timedelta:
    """``k2b_now()``'s offset on ``conn`` (psycopg, autocommit) after it set a day."""
    conn.execute("SELECT set_config('k2b.clock_offset', %s, false)", [DAY])
    return conn.execute(OFFSET_SQL).fetchone()[0]


def test_a_runtime_role_session_cannot_move_k2b_now(runtime):
    conn = db.autocommit_connection(RUNTIME, follow_clock=False)
    try:
        assert offset_after_setting(conn) == dt.timedelta(0)
    finally:
        conn.close()


def test_the_runtime_role_cannot_switch_the_offset_on(runtime):
    conn = db.autocommit_connection(RUNTIME, follow_clock=False)
    try:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            clock.honour_offset(conn, True)
        assert offset_after_setting(conn) == dt.timedelta(0)
    finally:
        conn.close()


def test_the_controlled_clock_moves_k2b_now_while_it_runs_and_not_after():
    with controlled_clock() as k2b_clock:
        k2b_clock.advance(days=1)
        with connection.cursor() as cursor:
            cursor.execute(OFFSET_SQL)
            assert cursor.fetchone()[0] == dt.timedelta(days=1)
    conn = db.autocommit_connection("default", follow_clock=False)
    try:
        assert offset_after_setting(conn) == dt.timedelta(0)
    finally:
        conn.close()


def test_through_a_transaction_pooler_a_left_setting_does_not_move_the_next_clients_clock(
    runtime,
):
    """The review's attack: one server connection, the attacker's setting left on it."""
    pgbouncer.require()
    settings = connections["default"].settings_dict
    user = "embedded_postgres" if hasattr(os, "geteuid") and os.geteuid() == 0 else None
    bouncer = pgbouncer.Bouncer(
        settings["HOST"] or "127.0.0.1",
        int(settings["PORT"] or 5432),
        "transaction",
        user,
        users=(runtime,),
        default_pool_size=1,
    )
    try:
        url = bouncer.url(settings["NAME"], user=runtime)
        with (
            psycopg.connect(url, autocommit=True, prepare_threshold=None) as attacker,
            psycopg.connect(url, autocommit=True, prepare_threshold=None) as worker,
        ):
            attacker.execute("SELECT set_config('k2b.clock_offset', %s, false)", [DAY])
            shared = attacker.execute("SELECT pg_backend_pid()").fetchone()[0]
            # One server connection in the pool: the worker's statements run on it,
            # where the attacker's setting stayed.
            assert worker.execute("SELECT pg_backend_pid()").fetchone()[0] == shared
            assert (
                worker.execute("SELECT current_setting('k2b.clock_offset', true)").fetchone()[0]
                == DAY
            )
            assert worker.execute(OFFSET_SQL).fetchone()[0] == dt.timedelta(0)
    finally:
        bouncer.stop()


def test_a_function_replaced_by_anyone_but_the_owner_is_refused(runtime):
    with pytest.raises(DatabaseError) as caught:
        runtime_role.as_runtime(clock.OFFSET_SQL)
    assert db.sqlstate(caught.value) == "42501"
