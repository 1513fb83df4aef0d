"""The two database roles: an owner that migrates and purges, a runtime role for web and workers.

The failure this is built around: the append-only triggers are only as strong
as the role that could switch them off. The table owner can ``DISABLE
TRIGGER`` or replace ``_pgtrigger_should_ignore()``; any role with UPDATE or
DELETE can set ``pgtrigger.ignore`` for its session and then edit evidence.
So web and workers connect as a role that owns nothing and holds only
``SELECT, INSERT`` on the journal, the ledger and the budget charges: the
database itself refuses UPDATE, DELETE and TRUNCATE there, whatever the
session settings say. ``purgeworkflows`` connects as the owner
(``K2B_WORKFLOWS["OWNER_DATABASE"]``).
"""

from __future__ import annotations

from django.apps import apps
from django.db import connections
from psycopg import sql

#: Tables whose rows are evidence: the runtime role may only add and read.
#: ``k2b_task_attempt``: a django.tasks task's failed calls, written once by its worker (#37).
APPEND_ONLY_TABLES = ("k2b_journal", "k2b_ledger", "k2b_budget_charge", "k2b_task_attempt")
_FORBIDDEN = ("UPDATE", "DELETE", "TRUNCATE")
#: Tables whose rows the runtime role removes itself: workers purge the fleet
#: rows of stopped or lost workers as they beat (``fleet.py``), and wait
#: rendezvous nobody consumed in their housekeeping (``kernel/waits.py``).
#: The admin's overview drops its per-minute counts older than two days
#: (``admin/overview.py``). None holds evidence. And schedules an operator deletes
#: in the admin, with their skipped-tick records (their runs stay), and the row of
#: a paused queue, which its resume deletes (#49). Nothing else. A run's progress
#: (``k2b_progress``, #49) is display: the runtime role writes it, as every table
#: not named here (SELECT, INSERT, UPDATE), and never deletes it: retention does.
RUNTIME_DELETES = (
    "k2b_overview_minute",
    "k2b_queue_pause",
    "k2b_schedule",
    "k2b_schedule_skip",
    "k2b_wait",
    "k2b_worker",
)
#: Tables the runtime role may only read (#35): the rate-limit stamps decide how
#: often an effect may happen, and deleting them let 4 dispatches through a
#: 2-per-hour limit. ``k2b_rate_admit`` and ``k2b_rate_stamp`` (SECURITY DEFINER,
#: migration 0021) write them, and delete only rows their own window let go of.
RUNTIME_READS_ONLY = ("k2b_rate_dispatch",)
#: Columns the runtime role writes when it inserts a row and never changes (#35):
#: what decides how often an effect may happen. Each slot is given by
#: ``k2b_flow_admit`` (SECURITY DEFINER) alone and freed by the row's trigger;
#: a key or a workflow name changed under a run, or a limit raised, let three
#: runs of a limit-1 key inside the action at once; a raised budget let three
#: charges through a budget of one. The limits' seal (#47) is written with them and
#: never changes either. The runtime role may UPDATE every other column.
FROZEN_COLUMNS = {
    "k2b_run": ("workflow_name", "concurrency_key", "concurrency_limit", "holds_slot"),
    "k2b_budget_account": ("root_id", "effect_budget", "max_ai_calls", "max_steps", "limits_seal"),
}
#: The kernel's SQL functions (migrations 0009, 0016, 0021 and 0036): statements and
#: triggers call them as the runtime role. None takes an argument that decides
#: how often an effect may happen: the limit a slot is given under is read from
#: the rows, and a rate window never deletes a younger one's rows.
KERNEL_FUNCTIONS = (
    ("k2b_now", ""),
    ("k2b_queue_order", "timestamptz, bigint"),
    ("k2b_flow_holders", "text, text"),
    ("k2b_flow_admit", "text, text"),
    ("k2b_rate_admit", "text, integer, bigint, uuid, integer, bigint"),
    ("k2b_rate_stamp", "bigint"),
    ("k2b_fair_line", "uuid, text, text, double precision, timestamptz"),
)


def kernel_tables() -> list[str]:
    """Every table of the app, in a stable order."""
    config = apps.get_app_config("k2b_workflows")
    return sorted(
        {m._meta.db_table for m in config.get_models() if m._meta.managed and not m._meta.proxy}
    )


def runtime_grants(role: str, using: str) -> list[str]:
    """The statements that give ``role`` what web and workers need, and nothing more.

    Idempotent: everything is revoked first, so running them again after an
    upgrade that added a table leaves exactly these privileges. Rendered from
    ``grant_statements``: every identifier is quoted and escaped by psycopg.
    """
    conn = connections[using]
    conn.ensure_connection()
    return [statement.as_string(conn.connection) for statement in grant_statements(role, using)]


_SCHEMA_SQL = "SELECT pg_catalog.current_schema()"

_GRANT_SCHEMA_SQL = "GRANT USAGE ON SCHEMA {} TO {}"

_REVOKE_ALL_SQL = "REVOKE ALL ON TABLE {} FROM {}"

_GRANT_APPEND_SQL = "GRANT SELECT, INSERT ON TABLE {} TO {}"

_GRANT_MUTABLE_SQL = "GRANT SELECT, INSERT, UPDATE ON TABLE {} TO {}"

_GRANT_COLUMNS_SQL = "GRANT SELECT, INSERT, UPDATE ({}) ON TABLE {} TO {}"

_GRANT_READ_SQL = "GRANT SELECT ON TABLE {} TO {}"

_GRANT_DELETE_SQL = "GRANT DELETE ON TABLE {} TO {}"

_GRANT_SEQUENCES_SQL = "GRANT USAGE, SELECT ON SEQUENCE {} TO {}"

_GRANT_FUNCTIONS_SQL = "GRANT EXECUTE ON FUNCTION {} TO {}"


def grant_statements(role: str, using: str) -> list[sql.Composed]:
    """``runtime_grants`` as composed statements, identifiers passed as ``sql.Identifier``.

    The role name comes from the command line: ``x"; CREATE TABLE ...; --``
    must name a role (that does not exist), never close the quote.
    """
    if not isinstance(role, str) or not role or "\x00" in role:
        raise ValueError("the role name must be a non-empty string without NUL")
    tables = kernel_tables()
    with connections[using].cursor() as cursor:
        cursor.execute(_SCHEMA_SQL)
        schema = cursor.fetchone()[0]
    mutable = [
        t
        for t in tables
        if t not in APPEND_ONLY_TABLES and t not in RUNTIME_READS_ONLY and t not in FROZEN_COLUMNS
    ]
    grantee = sql.Identifier(role)

    def names(items: list[str] | tuple[str, ...]) -> sql.Composed:
        return sql.SQL(", ").join(sql.Identifier(t) for t in items)

    statements = [
        sql.SQL(_GRANT_SCHEMA_SQL).format(sql.Identifier(schema), grantee),
        sql.SQL(_REVOKE_ALL_SQL).format(names(tables), grantee),
        sql.SQL(_GRANT_APPEND_SQL).format(names(APPEND_ONLY_TABLES), grantee),
        sql.SQL(_GRANT_MUTABLE_SQL).format(names(mutable), grantee),
    ]
    for table, frozen in FROZEN_COLUMNS.items():
        if table not in tables:
            continue
        statements.append(
            sql.SQL(_GRANT_COLUMNS_SQL).format(
                sql.SQL(", ").join(sql.Identifier(c) for c in _columns(table) if c not in frozen),
                sql.Identifier(table),
                grantee,
            )
        )
    readable = [t for t in RUNTIME_READS_ONLY if t in tables]
    if readable:
        statements.append(sql.SQL(_GRANT_READ_SQL).format(names(readable), grantee))
    deletable = [t for t in RUNTIME_DELETES if t in tables]
    if deletable:
        statements.append(sql.SQL(_GRANT_DELETE_SQL).format(names(deletable), grantee))
    sequences = _owned_sequences(using, tables)
    if sequences:
        statements.append(
            sql.SQL(_GRANT_SEQUENCES_SQL).format(
                sql.SQL(", ").join(sql.Identifier(*name) for name in sequences), grantee
            )
        )
    # Every statement of the kernel reads the time through it. PUBLIC may execute
    # functions by default, but a hardened database revokes that default.
    # The flow-control functions too: the slot triggers run them as the runtime role.
    statements.append(
        sql.SQL(_GRANT_FUNCTIONS_SQL).format(
            sql.SQL(", ").join(
                sql.SQL("{}({})").format(sql.Identifier(schema, name), sql.SQL(args))
                for name, args in KERNEL_FUNCTIONS
            ),
            grantee,
        )
    )
    return [s if isinstance(s, sql.Composed) else sql.Composed([s]) for s in statements]


def _columns(table: str) -> list[str]:
    """The columns of one of the app's tables, in the model's order."""
    config = apps.get_app_config("k2b_workflows")
    for model in config.get_models():
        if model._meta.db_table == table:
            return [f.column for f in model._meta.concrete_fields]
    raise LookupError(table)


_SEQUENCES_SQL = """
SELECT DISTINCT n.nspname, s.relname
  FROM pg_catalog.pg_class s
  JOIN pg_catalog.pg_namespace n ON n.oid = s.relnamespace
  JOIN pg_catalog.pg_depend d ON d.classid = 'pg_catalog.pg_class'::regclass AND d.objid = s.oid
  JOIN pg_catalog.pg_class t ON t.oid = d.refobjid
 WHERE s.relkind = 'S' AND d.deptype IN ('a', 'i')
   AND t.oid = ANY(SELECT pg_catalog.to_regclass(name) FROM unnest(%s::text[]) AS name)
 ORDER BY 1, 2
"""


def _owned_sequences(using: str, tables: list[str]) -> list[tuple[str, str]]:
    """(schema, name) of the sequences behind the tables' serial or identity columns."""
    with connections[using].cursor() as cursor:
        cursor.execute(_SEQUENCES_SQL, [tables])
        return [(schema, name) for schema, name in cursor.fetchall()]


def owned_sequences(using: str, tables: list[str]) -> list[str]:
    """The sequences behind the tables' serial or identity columns, quoted for SQL text."""
    conn = connections[using]
    conn.ensure_connection()
    return [
        sql.Identifier(*name).as_string(conn.connection) for name in _owned_sequences(using, tables)
    ]


def apply_grants(role: str, using: str) -> list[str]:
    """Run ``grant_statements`` in one transaction (as the owner); returns what ran."""
    from django.db import transaction

    statements = grant_statements(role, using)
    conn = connections[using]
    with transaction.atomic(using=using), conn.cursor() as cursor:
        for statement in statements:
            cursor.execute(statement.as_string(conn.connection))
    return [statement.as_string(conn.connection) for statement in statements]


_SUPERUSER_SQL = "SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user"

_OWNS_TABLE_SQL = """
SELECT pg_has_role(current_user, c.relowner, 'MEMBER')
FROM pg_class c WHERE c.oid = to_regclass(%s)
"""

_TABLE_PRIVILEGE_SQL = "SELECT has_table_privilege(current_user, %s, %s)"

_COLUMN_UPDATE_PRIVILEGE_SQL = (
    "SELECT CASE WHEN to_regclass(%s) IS NOT NULL"
    " THEN has_column_privilege(current_user, %s, %s, 'UPDATE') END"
)

_TABLE_PRIVILEGE_IF_EXISTS_SQL = (
    "SELECT CASE WHEN to_regclass(%s) IS NOT NULL"
    " THEN has_table_privilege(current_user, %s, %s) END"
)


def excess_privileges(using: str) -> list[str]:
    """What the role connected on ``using`` could do to the append-only tables beyond
    INSERT and SELECT, or to the flow-control and budget state beyond what
    ``grantworkflows`` grants: each item is a bypass of the evidence's protection
    or of a limit."""
    problems = []
    with connections[using].cursor() as cursor:
        cursor.execute(_SUPERUSER_SQL)
        user, superuser = cursor.fetchone()
        if superuser:
            return [f"{user} is a superuser: it can disable every trigger"]
        for table in APPEND_ONLY_TABLES:
            cursor.execute(
                _OWNS_TABLE_SQL,
                [table],
            )
            row = cursor.fetchone()
            if row is None:
                continue  # not migrated yet
            if row[0]:
                problems.append(f"{user} owns {table}: it can DISABLE TRIGGER")
            for privilege in _FORBIDDEN:
                cursor.execute(_TABLE_PRIVILEGE_SQL, [table, privilege])
                if cursor.fetchone()[0]:
                    problems.append(f"{user} can {privilege} {table}")
        # What decides how often an effect may happen (#35).
        for table, frozen in FROZEN_COLUMNS.items():
            for column in frozen:
                cursor.execute(
                    _COLUMN_UPDATE_PRIVILEGE_SQL,
                    [table, table, column],
                )
                if cursor.fetchone()[0]:
                    problems.append(f"{user} can UPDATE {table}.{column}")
        for table in RUNTIME_READS_ONLY:
            for privilege in ("INSERT", "UPDATE", "DELETE"):
                cursor.execute(
                    _TABLE_PRIVILEGE_IF_EXISTS_SQL,
                    [table, table, privilege],
                )
                if cursor.fetchone()[0]:
                    problems.append(f"{user} can {privilege} {table}")
    return problems
