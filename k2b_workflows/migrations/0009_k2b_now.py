"""``k2b_now()``: the one expression the kernel's SQL reads the time with (#12).

``statement_timestamp()`` plus the session setting ``k2b.clock_offset``, which
nothing sets in production (the setting is absent: the offset is zero) and
``k2b_workflows.testing.clock()`` sets in tests, so that a test moves lease
expiry, retry backoff and wait deadlines without sleeping. A one-expression
``LANGUAGE sql STABLE`` function: PostgreSQL inlines it into each query, so
it costs a setting lookup, not a function call, and plans as
``statement_timestamp()`` did. Created in the schema the tables are in, and
executable by PUBLIC as every function is by default (``grantworkflows``
grants it to the runtime role too, for databases that revoke that default).
"""

from django.db import migrations

# Copied here, not imported: a migration keeps the SQL it ran.
CREATE_SQL = """
CREATE OR REPLACE FUNCTION k2b_now() RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT statement_timestamp()
           + coalesce(nullif(current_setting('k2b.clock_offset', true), ''), '0')::interval
$$;
"""

DROP_SQL = "DROP FUNCTION IF EXISTS k2b_now();"


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0008_run_error_detail"),
    ]

    operations = [migrations.RunSQL(CREATE_SQL, DROP_SQL)]
