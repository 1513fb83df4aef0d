"""The kernel's statements through libpq's pipeline (``kernel/pipeline.py``): prepared once
per connection, one round trip for several, errors and transactions as psycopg's own."""

from __future__ import annotations

import datetime as dt
import gc
import json
import time
import weakref
import zoneinfo

import psycopg
import psycopg.types.datetime
import psycopg.types.string
import pytest
from django.db import connection, transaction

from k2b_workflows.kernel import pipeline

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def conn():
    """Django's psycopg connection, new (nothing prepared on it yet)."""
    connection.close()
    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("CREATE TEMP TABLE pipe (k int PRIMARY KEY, v text, j jsonb, t timestamptz)")
    return connection.connection


def ours(conn) -> list[str]:
    with conn.cursor() as cursor:
        cursor.execute("SELECT name FROM pg_prepared_statements WHERE name LIKE '_k2b_%%'")
        return sorted(name for (name,) in cursor.fetchall())


def test_placeholders_are_numbered_and_percent_signs_unescaped():
    assert pipeline.numbered("SELECT %s, '%%', %s") == b"SELECT $1, '%', $2"
    assert pipeline.numbered("COMMIT") == b"COMMIT"


def test_statements_run_in_order_and_return_their_rows(conn):
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    rows = pipeline.round_trip(
        conn,
        [
            ("BEGIN", ()),
            ("INSERT INTO pipe VALUES (%s, %s, %s::jsonb, %s)", [1, "a", json.dumps([1]), when]),
            ("INSERT INTO pipe VALUES (%s, %s, NULL, NULL) RETURNING k", [2, None]),
            ("SELECT k, v, j, t FROM pipe WHERE k = %s", [1]),
            ("COMMIT", ()),
        ],
    )
    # Rows are loaded by the connection's adapters: Django's leave jsonb as text.
    assert rows == [[], [], [(2,)], [(1, "a", "[1]", when)], []]
    assert conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_a_statement_is_prepared_once_per_connection(conn):
    for k in (1, 2, 3):
        pipeline.round_trip(conn, [("INSERT INTO pipe (k) VALUES (%s)", [k])])
    assert len(ours(conn)) == 1
    # The same text with parameters of other types is another statement.
    pipeline.round_trip(conn, [("INSERT INTO pipe (k, v) VALUES (%s, %s)", [4, "x"])])
    pipeline.round_trip(conn, [("INSERT INTO pipe (k, v) VALUES (%s, %s)", [5, None])])
    assert len(ours(conn)) in (2, 3)


def test_a_statement_twice_in_one_round_trip_is_prepared_once(conn):
    insert = "INSERT INTO pipe (k) VALUES (%s)"
    pipeline.round_trip(conn, [(insert, [1]), (insert, [2])])
    assert len(ours(conn)) == 1


def test_past_the_cap_statements_run_unnamed(conn, monkeypatch):
    monkeypatch.setattr(pipeline, "MAX_PREPARED", 1)
    pipeline.round_trip(conn, [("INSERT INTO pipe (k) VALUES (%s)", [1])])
    rows = pipeline.round_trip(
        conn,
        [
            ("INSERT INTO pipe (k, v) VALUES (%s, %s)", [2, "b"]),
            ("SELECT array_agg(k ORDER BY k) FROM pipe WHERE k > %s", [0]),
        ],
    )
    assert rows == [[], [([1, 2],)]]
    assert len(ours(conn)) == 1


def test_a_failed_statement_skips_the_rest_and_raises_psycopgs_error(conn):
    with pytest.raises(psycopg.errors.UniqueViolation):
        pipeline.round_trip(
            conn,
            [
                ("BEGIN", ()),
                ("INSERT INTO pipe (k) VALUES (%s)", [1]),
                ("INSERT INTO pipe (k) VALUES (%s)", [1]),
                ("INSERT INTO pipe (k) VALUES (%s)", [2]),
                ("COMMIT", ()),
            ],
        )
    # Nothing committed: the COMMIT was skipped, the transaction is left failed.
    assert conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.INERROR
    pipeline.round_trip(conn, [("ROLLBACK", ())])
    assert pipeline.round_trip(conn, [("SELECT count(*) FROM pipe WHERE k > %s", [0])]) == [[(0,)]]


def test_a_value_that_cannot_be_sent_fails_before_anything_is_queued(conn):
    with pytest.raises(psycopg.ProgrammingError):
        pipeline.round_trip(
            conn,
            [("BEGIN", ()), ("INSERT INTO pipe (k) VALUES (%s)", [1]), ("SELECT %s", [object()])],
        )
    # The BEGIN and the INSERT never left: the connection is idle and empty.
    assert conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert pipeline.round_trip(conn, [("SELECT count(*) FROM pipe WHERE k > %s", [0])]) == [[(0,)]]


def test_statements_deallocated_behind_its_back_are_prepared_again(conn):
    pipeline.round_trip(conn, [("INSERT INTO pipe (k) VALUES (%s)", [1])])
    with conn.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    with pytest.raises(psycopg.errors.InvalidSqlStatementName):
        pipeline.round_trip(conn, [("INSERT INTO pipe (k) VALUES (%s)", [2])])
    pipeline.round_trip(conn, [("INSERT INTO pipe (k) VALUES (%s)", [3])])
    assert pipeline.round_trip(conn, [("SELECT array_agg(k ORDER BY k) FROM pipe", ())]) == [
        [([1, 3],)]
    ]


def test_inside_an_atomic_block_the_transaction_begins_with_the_first_statement(conn):
    """Where psycopg would send BEGIN in a round trip of its own, it goes with the
    statement, and the block's commit (or rollback) ends that transaction."""
    with transaction.atomic():
        assert conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
        pipeline.round_trip(conn, [("INSERT INTO pipe (k) VALUES (%s)", [1])])
        assert conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    with pytest.raises(RuntimeError), transaction.atomic():
        pipeline.round_trip(conn, [("INSERT INTO pipe (k) VALUES (%s)", [2])])
        raise RuntimeError("rolled back")
    assert pipeline.round_trip(conn, [("SELECT array_agg(k) FROM pipe", ())]) == [[([1],)]]


def test_a_connection_lost_before_a_round_trip_raises_psycopgs_error(conn):
    pid = conn.info.backend_pid
    with psycopg.connect(conn.info.dsn, password=conn.info.password, autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
    with pytest.raises(psycopg.OperationalError):
        pipeline.round_trip(conn, [("SELECT %s", [1])])
    connection.close()  # Django's wrapper, for the test database's teardown


def test_a_connections_loaders_are_made_once_not_at_every_round_trip(conn):
    """The connection keeps one transformer: a column's loader is made the first time
    its type is read, as a cursor's is, not again for every round trip."""
    made = []

    class Counting(psycopg.types.string.TextLoader):
        def __init__(self, oid, context=None):
            super().__init__(oid, context)
            made.append(oid)

    conn.adapters.register_loader("text", Counting)
    pipeline.adapters_changed(conn)
    for k in (1, 2, 3):
        rows = pipeline.round_trip(conn, [("SELECT %s::text, 'b'::text", [str(k)])])
        assert rows == [[(str(k), "b")]]
    assert len(made) == 1


def test_a_loader_registered_later_is_used_once_the_kernel_is_told(conn):
    """``timestamps.install`` replaces Django's loader on a connection the kernel may
    have read from already; the next round trip reads with the new one."""
    paris = zoneinfo.ZoneInfo("Europe/Paris")
    select = [("SELECT %s::timestamptz", ["2026-01-02 03:04:05+00"])]
    assert pipeline.round_trip(conn, select)[0][0][0].tzinfo is not paris

    class InParis(psycopg.types.datetime.TimestamptzLoader):
        timezone = paris  # what Django's cursors look for

        def load(self, data):
            return super().load(data).astimezone(paris)

    conn.adapters.register_loader("timestamptz", InParis)
    pipeline.adapters_changed(conn)
    got = pipeline.round_trip(conn, select)[0][0][0]
    assert got.tzinfo is paris
    assert got == dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


def test_installing_the_kernels_timestamp_loader_renews_the_transformer(conn):
    """Django's loader put back on a connection (as when it connects anew) is replaced
    by the kernel's at its next statement, and that statement already reads with it."""
    from django.db.backends.postgresql.psycopg_any import register_tzloader

    from k2b_workflows.kernel import db, timestamps

    db.fetch_statement("default", "SELECT now()")
    paris = zoneinfo.ZoneInfo("Europe/Paris")
    register_tzloader(paris, conn)  # Django's, labeled with another zone
    (when,) = db.fetch_statement("default", "SELECT '2026-01-02 03:04:05+00'::timestamptz")[0]
    timestamptz = psycopg.postgres.types["timestamptz"].oid
    assert issubclass(
        conn.adapters.get_loader(timestamptz, psycopg.pq.Format.TEXT), timestamps.TzLoader
    )
    assert when.tzinfo is paris


def test_a_connection_dropped_without_close_is_freed_at_once(conn):
    """What the kernel keeps for a connection (its statements' names, its transformer)
    makes no reference cycle with it: a connection its thread drops without closing
    is freed, and its server session ends, when the last reference goes, not at
    the garbage collector's next full pass."""
    own = psycopg.connect(conn.info.dsn, prepare_threshold=0, autocommit=True)
    pid = own.info.backend_pid
    assert pipeline.round_trip(own, [("SELECT %s::int", [1])]) == [[(1,)]]
    gone = weakref.ref(own)
    gc.disable()
    try:
        del own
        assert gone() is None
    finally:
        gc.enable()
    deadline = time.monotonic() + 30  # the server ends the session once it reads the close
    with conn.cursor() as cursor:
        while True:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid])
            if cursor.fetchone()[0] == 0:
                break
            assert time.monotonic() < deadline, f"backend {pid} is still there"
            time.sleep(0.05)
