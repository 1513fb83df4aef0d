"""Flow control (#25): concurrency slots, priorities with aging, rate-limited dispatches.

The functions come first: the index on the line order and the slot triggers
call them. See ``k2b_workflows/kernel/flow.py`` for why each exists.

``k2b_queue_order`` is declared IMMUTABLE although ``timestamptz - interval``
is only STABLE: that operator depends on the time zone for intervals of days
or months, and this one subtracts milliseconds only. PL/pgSQL, as
``k2b_now()``, so that it is never inlined and the claim's ``ORDER BY``
matches the index expression.
"""

import django.db.models.deletion
import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

import k2b_workflows.models
import k2b_workflows.triggers

# Copied here, not imported: a migration keeps the SQL it ran.
FUNCTIONS_SQL = """
CREATE OR REPLACE FUNCTION k2b_queue_order(run_after timestamptz, credit_ms bigint)
RETURNS timestamptz LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE COST 1
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN run_after - credit_ms * interval '1 millisecond';
END;
$$;

CREATE OR REPLACE FUNCTION k2b_flow_holders(p_name text, p_key text) RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    held integer;
BEGIN
    -- Until the transaction ends: every admission, and every end of a holder
    -- (through k2b_flow_admit), of this key waits here, and the count below is
    -- read after the wait, in a snapshot that sees what the last holder of the
    -- lock committed. Never a count taken before the lock.
    PERFORM pg_advisory_xact_lock(hashtextextended('k2b.concurrency:' || p_name || ':' || p_key, 0));
    SELECT count(*) INTO held FROM "public".k2b_run
     WHERE workflow_name = p_name AND concurrency_key = p_key AND holds_slot;
    RETURN held;
END;
$$;

CREATE OR REPLACE FUNCTION k2b_flow_admit(p_name text, p_key text, p_limit integer)
RETURNS integer LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    held integer;
    admitted integer;
    app text;
BEGIN
    IF p_key IS NULL OR p_limit IS NULL THEN
        RETURN 0;
    END IF;
    held := "public".k2b_flow_holders(p_name, p_key);
    IF held >= p_limit THEN
        RETURN 0;
    END IF;
    -- SKIP LOCKED: a queued run without a slot is locked only by whoever is
    -- canceling it or re-queueing it, and a re-queue admits through this
    -- function itself once it holds the key's lock.
    WITH next AS (
        SELECT id FROM "public".k2b_run
         WHERE workflow_name = p_name AND concurrency_key = p_key
           AND status = 'queued' AND NOT holds_slot
         ORDER BY "public".k2b_queue_order(run_after, priority_credit_ms), created_at
         LIMIT p_limit - held
           FOR UPDATE SKIP LOCKED),
    admit AS (
        UPDATE "public".k2b_run r SET holds_slot = true FROM next WHERE r.id = next.id
        RETURNING r.app_id)
    SELECT count(*), min(admit.app_id) INTO admitted, app FROM admit;
    IF admitted > 0 THEN
        PERFORM pg_notify('k2b_workflows', app);
    END IF;
    RETURN admitted;
END;
$$;

CREATE OR REPLACE FUNCTION k2b_rate_admit(
    p_key text, p_limit integer, p_per_ms bigint, p_run uuid, p_seq integer, p_generation bigint,
    OUT dispatch_id bigint, OUT free_at timestamptz)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    now_ timestamptz;
    nth timestamptz;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('k2b.rate:' || p_key, 0));
    -- The time after the wait for the lock, on the database's clock (with the
    -- controlled clock's offset): a statement's own timestamp is from before it.
    now_ := clock_timestamp() + ("public".k2b_now() - statement_timestamp());
    DELETE FROM "public".k2b_rate_dispatch
     WHERE limit_key = p_key AND at <= now_ - p_per_ms * interval '1 millisecond';
    -- A reservation never stamped whose run moved on (a crash before the call): void.
    DELETE FROM "public".k2b_rate_dispatch d
     WHERE d.limit_key = p_key AND d.at IS NULL
       AND NOT EXISTS (SELECT 1 FROM "public".k2b_run r
                        WHERE r.id = d.run_id AND r.generation = d.generation
                          AND r.status = 'running');
    -- A reservation not stamped yet counts as a call made now (it is made later).
    SELECT COALESCE(at, now_) AS t INTO nth FROM "public".k2b_rate_dispatch
     WHERE limit_key = p_key ORDER BY t DESC OFFSET p_limit - 1 LIMIT 1;
    IF FOUND THEN
        -- Full: the window frees when the limit-th latest dispatch leaves it.
        free_at := nth + p_per_ms * interval '1 millisecond';
        RETURN;
    END IF;
    INSERT INTO "public".k2b_rate_dispatch (limit_key, at, reserved_at, run_id, seq, generation)
    VALUES (p_key, NULL, now_, p_run, p_seq, p_generation)
    RETURNING id INTO dispatch_id;
END;
$$;

CREATE OR REPLACE FUNCTION k2b_rate_stamp(p_id bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE "public".k2b_rate_dispatch
       SET at = clock_timestamp() + ("public".k2b_now() - statement_timestamp())
     WHERE id = p_id AND at IS NULL;
    RETURN FOUND;
END;
$$;
"""

DROP_FUNCTIONS_SQL = """
DROP FUNCTION IF EXISTS k2b_rate_stamp(bigint);
DROP FUNCTION IF EXISTS k2b_rate_admit(text, integer, bigint, uuid, integer, bigint);
DROP FUNCTION IF EXISTS k2b_flow_admit(text, text, integer);
DROP FUNCTION IF EXISTS k2b_flow_holders(text, text);
DROP FUNCTION IF EXISTS k2b_queue_order(timestamptz, bigint);
"""


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0014_pinned_functions_and_run_seals"),
    ]

    operations = [
        migrations.RunSQL(FUNCTIONS_SQL, DROP_FUNCTIONS_SQL),
        migrations.CreateModel(
            name="RateDispatch",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("limit_key", models.CharField(max_length=500)),
                ("at", models.DateTimeField(blank=True, null=True)),
                ("reserved_at", models.DateTimeField()),
                ("generation", models.BigIntegerField()),
                ("seq", models.IntegerField()),
            ],
            options={
                "verbose_name": "rate-limited dispatch",
                "db_table": "k2b_rate_dispatch",
                "ordering": ["-at"],
            },
        ),
        migrations.RemoveIndex(
            model_name="workflowrun",
            name="k2b_run_queued",
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="concurrency_key",
            field=models.CharField(blank=True, max_length=255, null=True),
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="concurrency_limit",
            field=models.IntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="holds_slot",
            field=models.BooleanField(default=False),
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="priority",
            field=models.IntegerField(default=0),
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="priority_credit_ms",
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="deferred_by",
            field=models.CharField(blank=True, default="", max_length=500),
        ),
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(
                k2b_workflows.models.QueueOrder("run_after", "priority_credit_ms"),
                condition=models.Q(
                    ("status", "queued"),
                    models.Q(
                        ("concurrency_key__isnull", True), ("holds_slot", True), _connector="OR"
                    ),
                ),
                name="k2b_run_queued",
            ),
        ),
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(
                condition=models.Q(
                    ("priority_credit_ms__gt", 0),
                    ("status", "queued"),
                    models.Q(
                        ("concurrency_key__isnull", True), ("holds_slot", True), _connector="OR"
                    ),
                ),
                fields=["run_after"],
                name="k2b_run_queued_priority",
            ),
        ),
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(
                condition=models.Q(("holds_slot", True)),
                fields=["workflow_name", "concurrency_key"],
                name="k2b_run_slots",
            ),
        ),
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(
                models.F("workflow_name"),
                models.F("concurrency_key"),
                k2b_workflows.models.QueueOrder("run_after", "priority_credit_ms"),
                condition=models.Q(
                    ("concurrency_key__isnull", False), ("holds_slot", False), ("status", "queued")
                ),
                name="k2b_run_behind_key",
            ),
        ),
        migrations.AddField(
            model_name="ratedispatch",
            name="run",
            field=models.ForeignKey(
                db_constraint=False,
                db_index=False,
                on_delete=django.db.models.deletion.DO_NOTHING,
                related_name="+",
                to="k2b_workflows.workflowrun",
            ),
        ),
        migrations.AddIndex(
            model_name="ratedispatch",
            index=models.Index(fields=["limit_key", "at"], name="k2b_rate_dispatch_key_at"),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="slot_release",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition="WHEN (OLD.\"holds_slot\" AND NEW.\"status\" IN ('succeeded', 'failed', 'canceled'))",
                    func="NEW.holds_slot := false; RETURN NEW;",
                    hash="38f41f90caf7f1638a0b4ce833efe7e5e926f9f4",
                    operation="UPDATE",
                    pgid="pgtrigger_slot_release_85e07",
                    table="k2b_run",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="slot_admit_insert",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition='WHEN (NEW."concurrency_key" IS NOT NULL AND NEW."status" = \'queued\')',
                    func='PERFORM "public".k2b_flow_admit(NEW.workflow_name, NEW.concurrency_key, NEW.concurrency_limit); RETURN NULL;',
                    hash="50f7fc9c63d6148997992db04c7882251581c364",
                    operation="INSERT",
                    pgid="pgtrigger_slot_admit_insert_0a60b",
                    table="k2b_run",
                    when="AFTER",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="slot_admit_update",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition='WHEN (NEW."concurrency_key" IS NOT NULL AND NOT NEW."holds_slot" AND (OLD."holds_slot" OR (NEW."status" = \'queued\' AND OLD."status" IS DISTINCT FROM (NEW."status"))))',
                    func='PERFORM "public".k2b_flow_admit(NEW.workflow_name, NEW.concurrency_key, NEW.concurrency_limit); RETURN NULL;',
                    hash="512b86688a0d98cae6051009e2ab20f1e1769046",
                    operation="UPDATE",
                    pgid="pgtrigger_slot_admit_update_26d1b",
                    table="k2b_run",
                    when="AFTER",
                ),
            ),
        ),
    ]
