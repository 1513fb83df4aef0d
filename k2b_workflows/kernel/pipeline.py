"""Several statements in one round trip, sent through libpq's pipeline directly.

The kernel's transactions are short runs of statements sent together ("BEGIN;
fence; append; COMMIT"). Through psycopg's ``Connection.pipeline()`` and its
cursors, each statement pays a cursor's bookkeeping and a poll and a send of
its own, which adds up to most of a short transaction's CPU in the worker,
and a worker process is bound by its GIL. Here the statements are queued in
libpq at once, followed by one sync, and their results read back in one
pass (docs/performance.md has the before and after). psycopg still does
the rest: its adapters dump the parameters and load the rows (the
connection's own, Django's loaders included), its error classes are raised,
and its ``wait`` blocks without holding the GIL.

Used on connections that prepare statements (``prepare_threshold`` set, as for
psycopg's own prepared statements): each statement with parameters is
prepared once per connection, under a name of its own (``_k2b_<n>``) that
psycopg's statement cache never reuses or deallocates. Outside autocommit
(inside Django's atomic block) the ``BEGIN`` that psycopg would send in a
round trip of its own goes with the first statements.
"""

from __future__ import annotations

import functools
import itertools
import re
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import psycopg
from psycopg import abc, errors, pq
from psycopg.abc import Buffer
from psycopg.adapt import PyFormat, Transformer
from psycopg.waiting import Ready, Wait

_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
_FATAL_ERROR = pq.ExecStatus.FATAL_ERROR
_PIPELINE_SYNC = pq.ExecStatus.PIPELINE_SYNC
_PIPELINE_ABORTED = pq.ExecStatus.PIPELINE_ABORTED
_PLACEHOLDER = re.compile(r"%([s%])")
_IDLE = pq.TransactionStatus.IDLE
_UNKNOWN_STATEMENT = "26000"  # invalid_sql_statement_name
#: Statements prepared per connection at most (psycopg's own cache keeps 100).
MAX_PREPARED = 200
#: In ``sent``: the transaction's start, sent ahead of the statements.
_BEGIN = ("BEGIN",)


class _WeakContext:
    """What a ``Transformer`` takes from its context: the connection's adapters, and
    the connection itself as a weak proxy.

    A transformer, and every loader it makes, keeps its context's connection. Given
    the connection itself, the transformer kept for it would make a cycle, and a
    connection dropped without ``close()`` (a thread's, at its end) would stay open
    on the server until the garbage collector's next full pass instead of closing
    once nothing refers to it.
    """

    __slots__ = ("adapters", "connection")

    def __init__(self, conn: psycopg.Connection) -> None:
        self.adapters = conn.adapters
        self.connection = weakref.proxy(conn)


class _Prepared(dict):
    """A connection's statements: (query, parameter types) -> the name prepared under;
    and the connection's ``Transformer``.

    The transformer is kept for the connection's life, as a cursor keeps its own
    across executes: it caches the dumper of each parameter type and the loader
    of each column type it has met. A transformer made for every round trip
    looked up and instantiated them again each time (a loader per column of
    every result): 3.5% of a no-op task's instructions in the worker. A
    connection is one thread's, as its statements' names are.
    """

    def __init__(self, conn: psycopg.Connection) -> None:
        super().__init__()
        self.names = itertools.count()
        self.tx = _transformer(conn)

    def new_name(self) -> bytes:
        return f"_k2b_{next(self.names)}".encode()


_prepared: weakref.WeakKeyDictionary[psycopg.Connection, _Prepared] = weakref.WeakKeyDictionary()


def _transformer(conn: psycopg.Connection) -> abc.Transformer:
    """The transformer kept for ``conn``: with its adapters, holding it only weakly."""
    return Transformer(_WeakContext(conn))


def adapters_changed(conn: psycopg.Connection) -> None:
    """A loader or dumper of ``conn`` was registered: the next round trip makes a
    transformer that has it (the statements' names stay)."""
    names = _prepared.get(conn)
    if names is not None:
        names.tx = _transformer(conn)


@functools.lru_cache(maxsize=512)
def numbered(sql: str) -> bytes:
    """``sql`` with its ``%s`` placeholders as ``$1, $2...`` (and ``%%`` as ``%``)."""
    count = 0

    def number(match: re.Match) -> str:
        nonlocal count
        if match.group(1) == "%":
            return "%"
        count += 1
        return f"${count}"

    return _PLACEHOLDER.sub(number, sql).encode()


class _Command(NamedTuple):
    """A statement ready to queue: parameters dumped, and its prepared name if it has one."""

    query: bytes
    values: Sequence[Buffer | None] | None = None
    formats: Sequence[pq.Format] | None = None
    types: tuple[int, ...] = ()
    name: bytes | None = None


def round_trip(
    conn: psycopg.Connection, statements: Sequence[tuple[str, Sequence[Any]]]
) -> list[list[tuple]]:
    """Run ``statements`` in one round trip; returns the rows of each (none for a command).

    As in any pipeline, a statement that fails makes the server skip the rest up
    to the sync, a ``COMMIT`` among them: the first error is raised (psycopg's
    class for its SQLSTATE) once every result is read.
    """
    names = _prepared.get(conn)
    if names is None:
        names = _prepared[conn] = _Prepared(conn)
    tx = names.tx
    # Every parameter is dumped before anything is queued: a value that cannot be
    # adapted must fail here, not leave half a transaction in libpq's buffer.
    commands: list[_Command] = []
    for sql, params in statements:
        query = numbered(sql)
        if not params:
            commands.append(_Command(query))
            continue
        values = tx.dump_sequence(params, [PyFormat.AUTO] * len(params))
        types = tuple(tx.types or ())
        name = names.get((query, types))
        commands.append(_Command(query, values, tuple(tx.formats or ()), types, name))
    with conn.lock:
        sent = _send(conn, names, commands)
        try:
            results = conn.wait(_exchange(conn.pgconn))
        except BaseException:
            conn.close()  # lost, or interrupted with results unread: not reusable
            raise
        conn.pgconn.exit_pipeline_mode()
    return _read(conn, tx, names, sent, results)


def _send(
    conn: psycopg.Connection,
    names: _Prepared,
    commands: list[_Command],
) -> list[tuple | None]:
    """Queue ``commands`` and a sync in pipeline mode; returns what each result will be:
    ``_BEGIN``, (key, name) of a statement prepared, or None for a statement run."""
    pgconn = conn.pgconn
    sent: list[tuple | None] = []
    pgconn.enter_pipeline_mode()
    try:
        if not conn.autocommit and pgconn.transaction_status == _IDLE:
            # What psycopg does before a statement outside autocommit (Django's
            # atomic block), in the same round trip instead of one of its own.
            pgconn.send_query_params(_begin(conn), None)
            sent.append(_BEGIN)
        preparing: dict[tuple, bytes] = {}  # in this round trip
        for command in commands:
            key = (command.query, command.types)
            name = command.name or preparing.get(key)
            if command.values is None:
                pgconn.send_query_params(command.query, None)
            elif name is None and len(names) + len(preparing) >= MAX_PREPARED:
                # Parameter types vary with values (psycopg sends a small int as
                # int2, a large one as int8): past the cap, unnamed statements.
                pgconn.send_query_params(
                    command.query,
                    command.values,
                    param_types=command.types,
                    param_formats=command.formats,
                )
            else:
                if name is None:
                    name = preparing[key] = names.new_name()
                    pgconn.send_prepare(name, command.query, param_types=command.types)
                    sent.append((key, name))
                pgconn.send_query_prepared(name, command.values, param_formats=command.formats)
            sent.append(None)
        pgconn.pipeline_sync()
    except BaseException:
        conn.close()  # what was queued must never be sent by the next statement
        raise
    return sent


def _begin(conn: psycopg.Connection) -> bytes:
    """The ``BEGIN`` psycopg would send, with the connection's transaction characteristics."""
    parts = [b"BEGIN"]
    if conn.isolation_level is not None:
        level = psycopg.IsolationLevel(conn.isolation_level).name.replace("_", " ")
        parts.append(b"ISOLATION LEVEL " + level.encode())
    if conn.read_only is not None:
        parts.append(b"READ ONLY" if conn.read_only else b"READ WRITE")
    if conn.deferrable is not None:
        parts.append(b"DEFERRABLE" if conn.deferrable else b"NOT DEFERRABLE")
    return b" ".join(parts)


def _read(
    conn: psycopg.Connection,
    tx: abc.Transformer,
    names: _Prepared,
    sent: list[tuple | None],
    results: list[pq.abc.PGresult],
) -> list[list[tuple]]:
    rows: list[list[tuple]] = []
    failure: psycopg.Error | None = None
    for prepares, result in zip(sent, results, strict=True):
        status = result.status
        if status == _FATAL_ERROR:
            failure = failure or errors.error_from_result(result, encoding=conn.info.encoding)
        elif status == _PIPELINE_ABORTED:
            failure = failure or errors.InternalError("pipeline aborted without an error")
        if prepares is not None:  # the BEGIN, or a statement prepared: no rows
            if prepares is not _BEGIN and status == _COMMAND_OK:
                key, name = prepares
                names[key] = name
            continue
        if status == _TUPLES_OK:
            tx.set_pgresult(result)
            rows.append(tx.load_rows(0, result.ntuples, tuple))
        else:
            rows.append([])
    if failure is not None:
        if failure.sqlstate == _UNKNOWN_STATEMENT:
            names.clear()  # deallocated behind our back (DEALLOCATE ALL): prepare again
        raise failure
    return rows


def _exchange(pgconn: pq.abc.PGconn) -> Any:
    """Flush what is queued, then read results up to the sync (a psycopg wait generator)."""
    while pgconn.flush():
        while not (yield Wait.W):
            continue
    results: list[pq.abc.PGresult] = []
    while True:
        while not (yield Wait.R) & Ready.R:
            continue
        pgconn.consume_input()
        while (notify := pgconn.notifies()) is not None:
            if pgconn.notify_handler:
                pgconn.notify_handler(notify)
        ended = False  # the last result read ended a statement's results
        while not pgconn.is_busy():
            result = pgconn.get_result()
            if result is None:
                if ended:
                    break  # nothing more has arrived: wait for it
                ended = True
                continue
            if result.status == _PIPELINE_SYNC:
                return results
            results.append(result)
            ended = False


class Cursor:
    """``execute``, ``fetchone`` and ``fetchall`` of a cursor, each statement a ``round_trip``."""

    __slots__ = ("connection", "rows")

    def __init__(self, connection: psycopg.Connection) -> None:
        self.connection = connection
        self.rows: list[tuple] = []

    def execute(self, sql: str, params: Sequence[Any] | None = ()) -> None:
        self.rows = round_trip(self.connection, [(sql, params or ())])[0]

    def fetchone(self) -> tuple | None:
        return self.rows.pop(0) if self.rows else None

    def fetchall(self) -> list[tuple]:
        rows, self.rows = self.rows, []
        return rows

    def close(self) -> None:
        self.rows = []
