"""``k2b_now()``: the one expression the kernel's SQL reads the time with (#12).

``statement_timestamp()`` plus the session setting ``k2b.clock_offset``, which
nothing sets in production (the setting is absent: the offset is zero) and
``k2b_workflows.testing.controlled_clock()`` sets in tests, so that a test
moves lease expiry, retry backoff and wait deadlines without sleeping.

PL/pgSQL, not an inlinable ``LANGUAGE sql`` function: the kernel's statements
reach the server unprepared, so each is planned anew, and inlining a SQL
function costs more planning (~15 us an occurrence, measured: +8% on a claim
of ten runs, +15% on the fence) than calling this one costs (~1 us a call:
+2 to +3%). ``STABLE`` keeps it usable in index conditions; ``COST 1`` (that
of ``statement_timestamp()``) keeps every plan what it was. Created in the
schema the tables are in; PUBLIC may execute it as every function by default,
and ``grantworkflows`` grants it to the runtime role for databases that revoke
that default.
"""

from django.db import migrations

# Copied here, not imported: a migration keeps the SQL it ran.
CREATE_SQL = """
CREATE OR REPLACE FUNCTION k2b_now() RETURNS timestamptz
LANGUAGE plpgsql STABLE PARALLEL SAFE COST 1
AS $$
BEGIN
    RETURN statement_timestamp()
           + coalesce(nullif(current_setting('k2b.clock_offset', true), ''), '0')::interval;
END;
$$;
"""

DROP_SQL = "DROP FUNCTION IF EXISTS k2b_now();"


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0008_run_error_detail"),
    ]

    operations = [migrations.RunSQL(CREATE_SQL, DROP_SQL)]
