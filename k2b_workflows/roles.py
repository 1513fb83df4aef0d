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

#: Tables whose rows are evidence: the runtime role may only add and read.
APPEND_ONLY_TABLES = ("k2b_journal", "k2b_ledger", "k2b_budget_charge")
_FORBIDDEN = ("UPDATE", "DELETE", "TRUNCATE")
#: Tables whose rows the runtime role removes itself: workers purge the fleet
#: rows of stopped or lost workers as they beat (``fleet.py``), and wait
#: rendezvous nobody consumed in their housekeeping (``kernel/waits.py``).
#: Neither holds evidence. And schedules an operator deletes in the admin, with
#: their skipped-tick records (their runs stay). Nothing else.
RUNTIME_DELETES = ("k2b_schedule", "k2b_schedule_skip", "k2b_wait", "k2b_worker")


def kernel_tables() -> list[str]:
    """Every table of the app, in a stable order."""
    config = apps.get_app_config("k2b_workflows")
    return sorted(
        {m._meta.db_table for m in config.get_models() if m._meta.managed and not m._meta.proxy}
    )


def runtime_grants(role: str, using: str) -> list[str]:
    """The statements that give ``role`` what web and workers need, and nothing more.

    Idempotent: everything is revoked first, so running them again after an
    upgrade that added a table leaves exactly these privileges.
    """
    connection = connections[using]
    quote = connection.ops.quote_name
    tables = kernel_tables()
    sequences = owned_sequences(using, tables)
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_schema()")
        schema = cursor.fetchone()[0]
    mutable = [t for t in tables if t not in APPEND_ONLY_TABLES]
    grantee = quote(role)

    def names(items: list[str] | tuple[str, ...]) -> str:
        return ", ".join(quote(t) for t in items)

    statements = [
        f"GRANT USAGE ON SCHEMA {quote(schema)} TO {grantee}",
        f"REVOKE ALL ON TABLE {names(tables)} FROM {grantee}",
        f"GRANT SELECT, INSERT ON TABLE {names(APPEND_ONLY_TABLES)} TO {grantee}",
        f"GRANT SELECT, INSERT, UPDATE ON TABLE {names(mutable)} TO {grantee}",
    ]
    deletable = [t for t in RUNTIME_DELETES if t in tables]
    if deletable:
        statements.append(f"GRANT DELETE ON TABLE {names(deletable)} TO {grantee}")
    if sequences:
        statements.append(f"GRANT USAGE, SELECT ON SEQUENCE {', '.join(sequences)} TO {grantee}")
    # Every statement of the kernel reads the time through it. PUBLIC may execute
    # functions by default, but a hardened database revokes that default.
    statements.append(f"GRANT EXECUTE ON FUNCTION {quote(schema)}.k2b_now() TO {grantee}")
    return statements


def owned_sequences(using: str, tables: list[str]) -> list[str]:
    """The sequences behind the tables' serial or identity columns (INSERT draws from them)."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            """SELECT DISTINCT s.oid::regclass::text
                 FROM pg_class s
                 JOIN pg_depend d ON d.classid = 'pg_class'::regclass AND d.objid = s.oid
                 JOIN pg_class t ON t.oid = d.refobjid
                WHERE s.relkind = 'S' AND d.deptype IN ('a', 'i')
                  AND t.oid = ANY(SELECT to_regclass(name) FROM unnest(%s::text[]) AS name)
                ORDER BY 1""",
            [tables],
        )
        return [row[0] for row in cursor.fetchall()]


def apply_grants(role: str, using: str) -> list[str]:
    """Run ``runtime_grants`` in one transaction (as the owner); returns what ran."""
    from django.db import transaction

    statements = runtime_grants(role, using)
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        for sql in statements:
            cursor.execute(sql)
    return statements


def excess_privileges(using: str) -> list[str]:
    """What the role connected on ``using`` could do to the append-only tables beyond
    INSERT and SELECT: each item is a bypass of the evidence's protection."""
    problems = []
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user")
        user, superuser = cursor.fetchone()
        if superuser:
            return [f"{user} is a superuser: it can disable every trigger"]
        for table in APPEND_ONLY_TABLES:
            cursor.execute(
                """SELECT pg_has_role(current_user, c.relowner, 'MEMBER')
                     FROM pg_class c WHERE c.oid = to_regclass(%s)""",
                [table],
            )
            row = cursor.fetchone()
            if row is None:
                continue  # not migrated yet
            if row[0]:
                problems.append(f"{user} owns {table}: it can DISABLE TRIGGER")
            for privilege in _FORBIDDEN:
                cursor.execute(
                    "SELECT has_table_privilege(current_user, %s, %s)", [table, privilege]
                )
                if cursor.fetchone()[0]:
                    problems.append(f"{user} can {privilege} {table}")
    return problems
