"""Schedule rows and AI task requests are sealed; the test clock is the owner's to switch on (#35).

A schedule pass starts runs from ``k2b_schedule`` rows and an AI worker calls
a provider with ``k2b_ai_task.request``: the runtime role wrote both, and the
kernel sealed what came out of them. Each gets a keyed seal
(``kernel/schedule_seals.py``, ``kernel/ai.py``); rows already there are
sealed as they are now, as 0014 sealed the runs: run it with the
``EVIDENCE_KEYS`` (or ``SECRET_KEY``) the workers use.

``k2b_now()`` added the session setting ``k2b.clock_offset``, which any
session can set (and, through a transaction pooler, leave on a server
connection other clients get). It is now the statement's timestamp and
nothing else; ``k2b_workflows.testing.controlled_clock()`` has the owner
install the offset-honouring body for as long as a test's clock runs
(``kernel/clock.py``).
"""

from django.db import migrations, models

# Copied here, not imported: a migration keeps the SQL it ran.
K2B_NOW_SQL = """
CREATE OR REPLACE FUNCTION k2b_now() RETURNS timestamptz
LANGUAGE plpgsql STABLE PARALLEL SAFE COST 1
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN pg_catalog.statement_timestamp();
END;
$$;
"""

# What 0014 created, for a migration back.
K2B_NOW_OFFSET_SQL = """
CREATE OR REPLACE FUNCTION k2b_now() RETURNS timestamptz
LANGUAGE plpgsql STABLE PARALLEL SAFE COST 1
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN pg_catalog.statement_timestamp()
           + COALESCE(
               NULLIF(pg_catalog.current_setting('k2b.clock_offset', true), ''),
               '0')::interval;
END;
$$;
"""


def seal_existing_rows(apps, schema_editor):
    from k2b_workflows.kernel import ai, schedule_seals

    db = schema_editor.connection.alias
    WorkflowSchedule = apps.get_model("k2b_workflows", "WorkflowSchedule")
    for row in WorkflowSchedule.objects.using(db).order_by("pk"):
        values = {name: getattr(row, name) for name in schedule_seals.SEALED_FIELDS}
        WorkflowSchedule.objects.using(db).filter(pk=row.pk).update(
            seal=schedule_seals.seal(values)
        )
    AiTask = apps.get_model("k2b_workflows", "AiTask")
    for task in AiTask.objects.using(db).filter(status__in=["queued", "running"]):
        seal = ai.request_seal(
            task.effect_key, task.run_id, task.seq, task.app_id, task.provider, task.request
        )
        AiTask.objects.using(db).filter(pk=task.pk).update(request_seal=seal)


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0022_tasks"),
    ]

    operations = [
        migrations.AddField(
            model_name="workflowschedule",
            name="seal",
            field=models.CharField(blank=True, default="", editable=False, max_length=100),
        ),
        migrations.AddField(
            model_name="aitask",
            name="request_seal",
            field=models.CharField(blank=True, default="", editable=False, max_length=100),
        ),
        migrations.RunPython(seal_existing_rows, migrations.RunPython.noop, elidable=True),
        migrations.RunSQL(K2B_NOW_SQL, K2B_NOW_OFFSET_SQL),
    ]
