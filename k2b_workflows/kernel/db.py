"""Transactions as the kernel needs them: conflicts retried, unknown commits named.

PostgreSQL facts this relies on (measured, see the project's notes):
40001, 40P01, 55P03 and 57014 roll the transaction back and are safe to
retry. A connection lost during COMMIT does not tell the outcome: that is
``CommitOutcomeUnknown``, and the caller must re-read the journal, never guess.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
from django.db import DatabaseError, OperationalError, ProgrammingError, connections, transaction

from ..exceptions import DatabaseNotMigrated, LeaseLost, RunCanceled
from . import attempts, clock, pipeline, timestamps

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE_SQLSTATES = frozenset({"40001", "40P01", "55P03", "57014"})


_held = threading.local()


def holds_run_lock() -> bool:
    """True while this thread is inside a transaction that locked its run row.

    A heartbeat from another connection would then wait for this thread's own
    lock: ``ctx.heartbeat()`` refuses instead of hanging.
    """
    return getattr(_held, "depth", 0) > 0


@contextmanager
def holding_run_lock() -> Iterator[None]:
    """Mark this thread as holding its run's lock for the block (nested blocks count)."""
    _held.depth = getattr(_held, "depth", 0) + 1
    try:
        yield
    finally:
        _held.depth -= 1


class CommitOutcomeUnknown(Exception):
    """The connection failed while committing: the transaction may or may not have committed."""


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a Django or psycopg error (Django wraps psycopg's as ``__cause__``)."""
    while exc is not None:
        state = getattr(exc, "sqlstate", None)
        if state:
            return state
        exc = exc.__cause__  # type: ignore[assignment]
    return None


def is_conflict(exc: BaseException) -> bool:
    return sqlstate(exc) in RETRYABLE_SQLSTATES


@contextmanager
def atomic(using: str) -> Iterator[transaction.Atomic]:
    """``transaction.atomic`` that turns an error raised by COMMIT into ``CommitOutcomeUnknown``."""
    body_done = False
    block = transaction.atomic(using=using)
    try:
        with block:
            yield block
            body_done = True
    except DatabaseError as exc:
        if body_done and not is_conflict(exc):
            raise CommitOutcomeUnknown(str(exc)) from exc
        raise


def _retrying_conflicts(transaction_once: Callable[[], T], attempts: int) -> T:
    """Run ``transaction_once`` (a whole transaction), again after a conflict, with jitter."""
    for attempt in range(1, attempts + 1):
        try:
            return transaction_once()
        except DatabaseError as exc:
            if not is_conflict(exc) or attempt == attempts:
                raise
            logger.info("transaction conflict (%s), retrying", sqlstate(exc))
            time.sleep(random.uniform(0, 0.01 * attempt))
    raise AssertionError("unreachable")


def run_in_transaction(fn: Callable[[], T], using: str, attempts: int = 5) -> T:
    """Run ``fn`` in its own transaction, retrying the whole transaction on a conflict."""

    def once() -> T:
        with atomic(using):
            return fn()

    return _retrying_conflicts(once, attempts)


def run_statement(fn: Callable[[], T], using: str, attempts: int = 5) -> T:
    """Run ``fn``, one statement that is its own transaction (autocommit), retrying conflicts.

    A lost connection while the statement ran does not tell whether it
    committed: that is ``CommitOutcomeUnknown``, as for a lost COMMIT. Inside
    an open ``transaction.atomic`` the statement joins it and errors propagate.
    """
    in_block = connections[using].in_atomic_block
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except DatabaseError as exc:
            if in_block:
                raise
            if is_conflict(exc) and attempt < attempts:
                logger.info("statement conflict (%s), retrying", sqlstate(exc))
                time.sleep(random.uniform(0, 0.01 * attempt))
                continue
            if isinstance(exc, OperationalError) and not is_conflict(exc):
                raise CommitOutcomeUnknown(str(exc)) from exc
            raise
    raise AssertionError("unreachable")


FENCE_SQL = f"""
UPDATE k2b_run
   SET lease_expires_at = k2b_now() + %s * interval '1 millisecond',
       updated_at = k2b_now(),
       current_step = COALESCE(%s, current_step),
       {attempts.SET}
 WHERE id = %s AND generation = %s AND status = 'running'
RETURNING cancel_requested_at IS NOT NULL
"""


def fence(
    using: str,
    run_id: uuid.UUID,
    generation: int,
    lease_ms: int,
    step: int | None = None,
    *,
    reset: attempts.Reset | None = None,
) -> bool:
    """Lock the run row until the surrounding transaction ends, and check we still own it.

    The UPDATE takes the row lock (like ``FOR NO KEY UPDATE``): a takeover,
    which raises ``generation``, waits for this transaction, and if it
    committed first this check fails and nothing we write commits. Returns
    whether a cancel asked the run to stop (#49), read under that lock.
    """
    conn = connections[using]
    if not conn.in_atomic_block:
        raise RuntimeError("fence() must run inside transaction.atomic")
    with statement_cursor(using) as cursor:
        cursor.execute(FENCE_SQL, [lease_ms, step, *attempts.params(reset), run_id, generation])
        row = cursor.fetchone()
        if row:
            return bool(row[0])
    raise lease_lost(using, run_id, generation)


_RUN_STATE_SQL = "SELECT status, generation FROM k2b_run WHERE id = %s"


def lease_lost(using: str, run_id: uuid.UUID, generation: int) -> Exception:
    """The error for a fence that matched no row: ``RunCanceled`` or ``LeaseLost``."""
    with connections[using].cursor() as cursor:
        cursor.execute(_RUN_STATE_SQL, [run_id])
        row = cursor.fetchone()
    return _lost(run_id, generation, row)


def not_ours(using: str, run_id: uuid.UUID, generation: int) -> Exception | None:
    """The fence's error (``RunCanceled``, ``LeaseLost``) if ``generation`` no longer
    holds ``run_id``, else None: a read, for a writer that learned only that its
    write was refused (``BatchRefused``) or that something changed (the lease
    keeper's abort signal), and must not write on for a run that is not its own."""
    with connections[using].cursor() as cursor:
        cursor.execute(_RUN_STATE_SQL, [run_id])
        row = cursor.fetchone()
    if row is not None and row[0] == "running" and row[1] == generation:
        return None
    return _lost(run_id, generation, row)


def _lost(run_id: uuid.UUID, generation: int, row: tuple | None) -> Exception:
    if row and row[0] == "canceled":
        return RunCanceled(f"run {run_id} was canceled")
    return LeaseLost(
        f"run {run_id}: generation {generation} no longer holds the lease"
        + (f" (now {row[0]}, generation {row[1]})" if row else "")
    )


# undefined_table, undefined_column, undefined_function (``k2b_now()``): what our own
# SQL meets on an unmigrated database.
_SCHEMA_SQLSTATES = frozenset({"42P01", "42703", "42883"})
MIGRATE_HINT = "the k2b_workflows tables are missing or out of date: run `manage.py migrate`"


@contextmanager
def schema_required() -> Iterator[None]:
    """Turn "relation k2b_run does not exist" into ``DatabaseNotMigrated``, one clear line.

    Wrap only the kernel's own statements: a user's query failing on a missing
    table of their own is their error, not ours to reword.
    """
    try:
        yield
    except ProgrammingError as exc:
        if sqlstate(exc) in _SCHEMA_SQLSTATES:
            first_line = (str(exc).strip().splitlines() or [""])[0]
            raise DatabaseNotMigrated(f"{MIGRATE_HINT} ({first_line})") from exc
        raise


def check_migrated(using: str) -> None:
    """Raise ``DatabaseNotMigrated`` unless every migration of this app is applied.

    A worker must not start on a database older than its code: the first claim
    would fail on a missing column, in a loop that treats errors as weather.

    The usual answer is yes, and it costs two small reads: every migration file
    of this app is recorded as applied. Django's planner, which imports the
    migrations of every installed app to build their graph (about 20 ms of a
    worker's start), only decides the rest: a migration missing, or a squashed
    one whose replaced migrations are what the table records.
    """
    if _all_recorded(using):
        return
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connections[using])
    targets = [n for n in executor.loader.graph.leaf_nodes() if n[0] == "k2b_workflows"]
    plan = executor.migration_plan(targets)
    if plan:
        missing = ", ".join(f"{m.app_label}.{m.name}" for m, _ in plan[:3])
        raise DatabaseNotMigrated(f"{MIGRATE_HINT} (not applied: {missing})")


#: How many of these migrations of the app are applied.
_MIGRATED_SQL = (
    "SELECT count(DISTINCT name) FROM django_migrations WHERE app = %s AND name = ANY(%s)"
)


def _all_recorded(using: str) -> bool:
    """Whether ``django_migrations`` names every migration module of this app (found,
    not imported, where ``MIGRATION_MODULES`` or the default puts them)."""
    import importlib.util
    import pkgutil

    from django.db.migrations.loader import MigrationLoader
    from django.db.migrations.recorder import MigrationRecorder

    recorder = MigrationRecorder(connections[using])
    if not recorder.has_table():  # a database never migrated: the planner says so
        return False
    module, _ = MigrationLoader.migrations_module("k2b_workflows")
    spec = importlib.util.find_spec(module) if module else None
    if spec is None or not spec.submodule_search_locations:
        return False
    found = pkgutil.iter_modules(spec.submodule_search_locations)
    names = [m.name for m in found if not m.ispkg and m.name[0] not in "_~"]  # as Django's
    if not names:
        return False
    with connections[using].cursor() as cursor:
        cursor.execute(
            _MIGRATED_SQL,
            ["k2b_workflows", names],
        )
        return cursor.fetchone()[0] == len(names)


_LOCK_RUN_SQL = "SELECT status, generation, attention_step FROM k2b_run WHERE id = %s FOR UPDATE"


def lock_run(using: str, run_id: uuid.UUID) -> tuple[str, int, int | None] | None:
    """``SELECT ... FOR UPDATE`` the run row; returns (status, generation, attention_step)."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            _LOCK_RUN_SQL,
            [run_id],
        )
        return cursor.fetchone()


def autocommit_connection(using: str, *, follow_clock: bool = True) -> Any:
    """A new psycopg connection in autocommit, outside Django's connection handling.

    For what must not join a caller's transaction (renewing a lease) or must
    not be handed to another borrower by a pool (a LISTEN). The caller closes it.
    It reads ``k2b_now()`` on the kernel's clock (``kernel/clock.py``) unless
    ``follow_clock`` is False: a LISTEN reads no time, and its connection is
    held by ``notifies()`` for up to a poll, which would stall a test's clock.
    """
    wrapper = connections[using]
    conn = wrapper.get_new_connection(wrapper.get_connection_params())
    conn.autocommit = True
    if follow_clock:
        clock.follow(conn)
    return conn


def from_json(value: Any) -> Any:
    """Decode a jsonb column read with raw SQL.

    Django configures psycopg to hand jsonb over as text (its ``JSONField``
    decodes it), so raw queries must decode it themselves.
    """
    return json.loads(value) if isinstance(value, str) else value


class statement_cursor:
    """A psycopg cursor on Django's connection for ``using``, without Django's wrapper.

    For the kernel's own statements on the hot path, run once or more per step.
    Through ``connection.cursor()`` every statement pays Django's wrapper and,
    with client-side binding (Django's default), psycopg quoting each parameter
    into the SQL in Python. Here, when the connection prepares statements
    (``DATABASES[...]["OPTIONS"]["prepare_threshold"]`` set; Django's default
    is ``None``: off, for connection poolers), each statement is prepared once
    per connection and sent through libpq's pipeline (``pipeline.Cursor``):
    the server neither parses nor plans it again, and parameters travel apart
    from it, dumped by psycopg's C code. Otherwise a client-side binding
    cursor (``psycopg.ClientCursor``): an unprepared statement costs the
    server less in one simple-protocol message, which can also carry several
    statements (see ``_around``).

    The same checks as Django's cursor come first (health check, connection,
    broken transaction, thread), and errors are Django's (``DatabaseError`` with
    psycopg's as ``__cause__``). What is not seen: ``connection.queries`` under
    ``DEBUG`` and ``connection.execute_wrapper()`` hooks.
    """

    __slots__ = ("cursor", "errors", "wrapper")

    def __init__(self, using: str) -> None:
        self.wrapper = connections[using]

    def __enter__(self) -> Any:
        wrapper = self.wrapper
        wrapper.close_if_health_check_failed()
        wrapper.ensure_connection()
        wrapper.validate_thread_sharing()
        wrapper.validate_no_broken_transaction()
        self.errors = wrapper.wrap_database_errors
        self.errors.__enter__()
        conn = wrapper.connection
        if timestamps.install(conn):
            pipeline.adapters_changed(conn)
        prepares = conn.prepare_threshold is not None
        self.cursor = (pipeline.Cursor if prepares else psycopg.ClientCursor)(conn)
        return self.cursor

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.cursor.close()
        self.errors.__exit__(exc_type, exc, tb)


def execute(using: str, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> int:
    with connections[using].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


def fetchall(using: str, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> list[tuple]:
    with connections[using].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def fetch_statement(
    using: str,
    sql: str,
    params: list[Any] | tuple[Any, ...] = (),
    *,
    setting: str | None = None,
) -> list[tuple]:
    """``fetchall`` for the kernel's hot statements, through ``statement_cursor``.

    ``setting``: a ``SET LOCAL`` for the statement's plan, sent in the same
    round trip; outside a transaction block the two make one implicit
    transaction, so it still applies.
    """
    if setting is None:
        with statement_cursor(using) as cursor:
            cursor.execute(sql, params)
            return cursor.fetchall()
    return _around(using, sql, params, before=setting)


#: A statement and its parameters.
Statement = tuple[str, Sequence[Any]]

_BEGIN_SQL = "BEGIN"
_COMMIT_SQL = "COMMIT"
_ROLLBACK_SQL = "ROLLBACK"


def _in_one_round_trip(using: str, statements: list[Statement]) -> list[list[tuple]]:
    """Run ``statements`` in one round trip; returns the rows of each (none for a command).

    A pipeline of (prepared) statements where the connection prepares them, one
    simple-protocol message of several statements otherwise. Either way a
    statement that fails makes the server skip the rest (a COMMIT among them too).
    """
    with statement_cursor(using) as cursor:
        if isinstance(cursor, psycopg.ClientCursor):
            cursor.execute(
                "; ".join(sql for sql, _ in statements),
                [value for _, params in statements for value in params],
            )
            results = []
            for position in range(len(statements)):
                if position:
                    cursor.nextset()
                results.append(_rows(cursor))
            return results
        return pipeline.round_trip(cursor.connection, statements)


def _rows(cursor: Any) -> list[tuple]:
    """The rows of the cursor's current result, none for a command. (Not through
    ``cursor.description``, which builds a column object per column to say so.)"""
    result = cursor.pgresult
    return cursor.fetchall() if result is not None and result.status == _TUPLES_OK else []


_TUPLES_OK = psycopg.pq.ExecStatus.TUPLES_OK


def _around(
    using: str,
    sql: str,
    params: list[Any] | tuple[Any, ...],
    *,
    before: str | None = None,
    after: str | None = None,
    one: bool = False,
) -> Any:
    """Run ``before``, ``sql`` and ``after`` (the two without parameters) in one round trip;
    returns the rows of ``sql`` (its first row with ``one``)."""
    statements: list[Statement] = [(part, ()) for part in (before,) if part]
    statements.append((sql, params))
    statements += [(part, ()) for part in (after,) if part]
    rows = _in_one_round_trip(using, statements)[1 if before else 0]
    return (rows[0] if rows else None) if one else rows


# -- a transaction in two round trips ---------------------------------------------------
#
# Through Django, a transaction costs a round trip for BEGIN (psycopg sends it
# before the first statement), one per statement, and one for COMMIT. "BEGIN;
# read" and "write; COMMIT", each in one round trip (``_around``), make a
# read-check-write transaction of two. Only outside ``transaction.atomic``
# (Django must not think it owns a transaction here).


def batches_statements(using: str) -> bool:
    """Whether ``begin_and_fetch``, ``commit_with`` and ``commit_batch`` may be used on
    this connection now. (Django's cursor class, ``OPTIONS["server_side_binding"]``,
    does not matter: ``statement_cursor`` picks its own.)"""
    return not connections[using].in_atomic_block


def begin_and_fetch(
    using: str, sql: str, params: list[Any], *, setting: str | None = None
) -> list[tuple]:
    """Open a transaction and run ``sql`` in it, in one round trip; returns its rows.

    ``setting``: a ``SET LOCAL`` sent before ``sql``, in the same round trip. The
    caller ends the transaction with ``commit_with``, ``fetch_and_commit`` or
    ``rollback_quietly``.
    """
    statements: list[Statement] = [(_BEGIN_SQL, ())]
    if setting:
        statements.append((setting, ()))
    statements.append((sql, params))
    try:
        return _in_one_round_trip(using, statements)[-1]
    except BaseException:
        # A failed read leaves the transaction open and aborted: end it here, or the
        # connection's next statement (Django believes it is in autocommit) fails.
        rollback_quietly(using)
        raise


def fetch_and_commit(using: str, sql: str, params: list[Any]) -> list[tuple]:
    """Run ``sql`` (a read) and COMMIT in the transaction ``begin_and_fetch`` opened, in
    one round trip; returns its rows. An error rolls back and is raised as it is: a
    connection lost on the way leaves the commit's outcome unknown, as for any
    COMMIT (the caller's writes are ones whose outcome it can read back)."""
    try:
        return _around(using, sql, params, after=_COMMIT_SQL)
    except BaseException:
        rollback_quietly(using)
        raise


def commit_open(using: str) -> None:
    """COMMIT the transaction ``begin_and_fetch`` opened, as ``fetch_and_commit`` does."""
    try:
        _in_one_round_trip(using, [(_COMMIT_SQL, ())])
    except BaseException:
        rollback_quietly(using)
        raise


def commit_with(using: str, sql: str, params: list[Any]) -> tuple | None:
    """Run ``sql`` and COMMIT in the transaction ``begin_and_fetch`` opened, in one round
    trip; returns the statement's first row.

    A failed statement skips the COMMIT (the server drops the rest of the
    message): the transaction is rolled back and the error raised. A connection
    lost on the way is ``CommitOutcomeUnknown``.
    """
    return _commit(using, [(sql, params), (_COMMIT_SQL, ())])[0]


class BatchRefused(Exception):
    """A batched transaction wrote nothing: a guard of one of its statements failed.
    The caller takes its statement-at-a-time path, which says why."""


#: The columns a guarded write (``evidence``'s strict appends) leaves NULL when its
#: guard fails, making the statement, and with it the whole batch, fail.
_GUARD_COLUMNS = frozenset({("k2b_journal", "run_id"), ("k2b_ledger", "run_id")})


def guard_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is a strict append finding the run or its chain not as expected."""
    while exc is not None:
        diag = getattr(exc, "diag", None)
        if diag is not None and getattr(exc, "sqlstate", None) == "23502":
            return (diag.table_name, diag.column_name) in _GUARD_COLUMNS
        exc = exc.__cause__  # type: ignore[assignment]
    return False


def commit_batch(
    using: str, statements: list[Statement], *, begin: bool = True, attempts: int = 5
) -> list[tuple | None]:
    """BEGIN, ``statements`` and COMMIT in one round trip; returns each statement's first row.

    The server runs every statement up to the first error, so each must do all
    of its part or fail: a statement that merely matches no row does not stop
    the COMMIT. ``evidence``'s strict appends fail that way (``guard_failed``)
    and carry the run's fence. Raises ``BatchRefused`` when a guard failed,
    after rolling back; a conflict retries the whole; a connection lost on the
    way is ``CommitOutcomeUnknown``.

    ``begin=False``: in the transaction ``begin_and_fetch`` opened; a conflict is
    raised (after rolling back), for the caller to retry the whole.
    """
    parts = [*statements, (_COMMIT_SQL, ())]
    if not begin:
        return _commit(using, parts)[:-1]
    parts.insert(0, (_BEGIN_SQL, ()))
    return _retrying_conflicts(lambda: _commit(using, parts)[1:-1], attempts)


def _commit(using: str, parts: list[Statement], *, rolls_back: bool = True) -> list[tuple | None]:
    """Send ``parts``, the last a COMMIT; returns each one's first row.

    A conflict is raised as is, a failed guard as ``BatchRefused``, and a lost
    connection as ``CommitOutcomeUnknown``. ``rolls_back``: end the failed
    transaction here (False: a Django atomic block's exit will).
    """

    def rollback() -> None:
        if rolls_back:
            rollback_quietly(using)

    try:
        results = _in_one_round_trip(using, parts)
    except OperationalError as exc:
        if is_conflict(exc):
            rollback()
            raise
        raise CommitOutcomeUnknown(str(exc)) from exc
    except DatabaseError as exc:
        rollback()
        if guard_failed(exc):
            raise BatchRefused(str(exc)) from exc
        raise
    except BaseException:
        rollback()
        raise
    return [rows[0] if rows else None for rows in results]


def ends_in_atomic(using: str) -> bool:
    """Whether ``commit_in_atomic`` may end the transaction of the open atomic block:
    the outermost one, with nothing nested open, not doomed to roll back."""
    wrapper = connections[using]
    return (
        wrapper.in_atomic_block
        and len(wrapper.atomic_blocks) == 1
        and wrapper.commit_on_exit
        and not wrapper.needs_rollback
    )


def commit_in_atomic(using: str, sql: str, params: Sequence[Any]) -> tuple | None:
    """Run ``sql`` and COMMIT in one round trip from inside the outermost
    ``transaction.atomic`` block (``ends_in_atomic``), which then has nothing left
    to commit; returns the statement's first row.

    The block's exit still runs its ``on_commit`` hooks: Django's commit is psycopg's,
    which does nothing on a connection with no transaction open. ``sql`` must fail
    rather than match nothing (a strict append), or the COMMIT would commit what
    came before it regardless. A failed guard is ``BatchRefused``, a conflict or
    another error is raised as is (the block's exit rolls back), and a connection
    lost on the way is ``CommitOutcomeUnknown``.
    """
    return _commit(using, [(sql, params), (_COMMIT_SQL, ())], rolls_back=False)[0]


def read_then_write(
    using: str,
    read_sql: str,
    read_params: list[Any],
    decide: Callable[[list[tuple]], list[Statement] | None],
    attempts: int = 5,
) -> tuple[bool, list[tuple | None]]:
    """One transaction in two round trips: "BEGIN; read", then the statements
    ``decide(rows)`` returns and COMMIT, or ROLLBACK when it returns None.

    Returns (written, each statement's first row). A conflict retries the whole,
    as ``run_in_transaction`` does; a failed guard is ``BatchRefused``.
    """

    def once() -> tuple[bool, list[tuple | None]]:
        rows = begin_and_fetch(using, read_sql, read_params)
        try:
            statements = decide(rows)
        except BaseException:
            rollback_quietly(using)
            raise
        if statements is None:
            rollback_quietly(using)
            return False, []
        return True, commit_batch(using, statements, begin=False)

    return _retrying_conflicts(once, attempts)


def rollback_quietly(using: str) -> None:
    """End a transaction ``begin_and_fetch`` opened, whatever state it is in."""
    try:
        _in_one_round_trip(using, [(_ROLLBACK_SQL, ())])
    except DatabaseError:
        # The connection is gone: the server rolled the transaction back.
        connections[using].close()
