"""Flow control the runtime role cannot bend (#35): slots, the limit, rate-limit stamps.

- ``k2b_flow_admit(name, key)`` takes no limit: a caller asked for 1,000 and
  got 1,000 runs of a limit-1 key inside the action. The limit is now the
  least among the key's holders and the run being admitted (each run's
  ``concurrency_limit`` is written at its start and never updated: the
  runtime role holds no UPDATE privilege on it, ``roles.py``). SECURITY
  DEFINER: the only writer of ``holds_slot = true``.
- ``k2b_rate_admit`` and ``k2b_rate_stamp`` are SECURITY DEFINER, and the
  runtime role may only read ``k2b_rate_dispatch``: deleting its rows let 4
  dispatches through a 2-per-hour limit. Each row keeps the window it was
  admitted under (``window_ms``) and is deleted only once that has passed,
  whatever window a later caller passes.
- Admission takes only runs that are due: a run started with a ``run_after``
  holds no slot before it may be claimed (one in year 9999 held the key's
  only slot). ``k2b_run_delayed_keyed`` lets the housekeeping find the keyed
  runs that became due since its last pass.
- The slot triggers: a run canceled while its lease is live keeps its slot
  until its worker has left ``run()`` (``triggers.SlotRelease``); a run is
  never inserted holding one (``triggers.SlotNeverInserted``).
"""

import importlib

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

import k2b_workflows.triggers

# Copied here, not imported: a migration keeps the SQL it ran.
FUNCTIONS_SQL = """
CREATE OR REPLACE FUNCTION k2b_flow_admit(p_name text, p_key text)
RETURNS integer LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    held integer;
    cap integer;
    admitted integer := 0;
    app text;
    next_run record;
BEGIN
    IF p_key IS NULL THEN
        RETURN 0;
    END IF;
    held := "public".k2b_flow_holders(p_name, p_key);
    -- The limit is never a caller's: the least any holder was started with
    -- (a deploy that lowers it takes effect at once, one that raises it once
    -- the holders started before it have ended), and below, the admitted
    -- run's own. A row the runtime role inserts can only lower it.
    SELECT min(concurrency_limit) INTO cap FROM "public".k2b_run
     WHERE workflow_name = p_name AND concurrency_key = p_key AND holds_slot;
    LOOP
        -- SKIP LOCKED: a queued run without a slot is locked only by whoever is
        -- canceling it or re-queueing it, and a re-queue admits through this
        -- function itself once it holds the key's lock.
        SELECT id, concurrency_limit, app_id INTO next_run FROM "public".k2b_run
         WHERE workflow_name = p_name AND concurrency_key = p_key
           AND status = 'queued' AND NOT holds_slot
           -- Only a run that may be claimed now: one started with a run_after
           -- takes no slot before it is due (the housekeeping admits it then).
           AND run_after <= "public".k2b_now()
         ORDER BY "public".k2b_queue_order(run_after, priority_credit_ms), created_at
         LIMIT 1
           FOR UPDATE SKIP LOCKED;
        EXIT WHEN NOT FOUND;
        cap := LEAST(cap, next_run.concurrency_limit);
        EXIT WHEN cap IS NULL OR held >= cap;
        UPDATE "public".k2b_run SET holds_slot = true WHERE id = next_run.id;
        held := held + 1;
        admitted := admitted + 1;
        app := COALESCE(app, next_run.app_id);
    END LOOP;
    IF admitted > 0 THEN
        PERFORM pg_notify('k2b_workflows', app);
    END IF;
    RETURN admitted;
END;
$$;

CREATE OR REPLACE FUNCTION k2b_rate_admit(
    p_key text, p_limit integer, p_per_ms bigint, p_run uuid, p_seq integer, p_generation bigint,
    OUT dispatch_id bigint, OUT free_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    now_ timestamptz;
    nth timestamptz;
BEGIN
    IF p_limit IS NULL OR p_limit < 1 OR p_per_ms IS NULL OR p_per_ms < 1 THEN
        RAISE EXCEPTION 'k2b_rate_admit: a limit of % per % ms admits nothing', p_limit, p_per_ms
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('k2b.rate:' || p_key, 0));
    -- The time after the wait for the lock, on the database's clock (with the
    -- controlled clock's offset): a statement's own timestamp is from before it.
    now_ := clock_timestamp() + ("public".k2b_now() - statement_timestamp());
    -- Only what its own window let go of: a caller passing a short window
    -- deletes nothing younger than the window it was admitted under.
    DELETE FROM "public".k2b_rate_dispatch
     WHERE limit_key = p_key
       AND at <= now_ - COALESCE(window_ms, p_per_ms) * interval '1 millisecond';
    -- A reservation never stamped whose run moved on (a crash before the call): void.
    DELETE FROM "public".k2b_rate_dispatch d
     WHERE d.limit_key = p_key AND d.at IS NULL
       AND NOT EXISTS (SELECT 1 FROM "public".k2b_run r
                        WHERE r.id = d.run_id AND r.generation = d.generation
                          AND r.status = 'running');
    -- A reservation not stamped yet counts as a call made now (it is made later).
    SELECT COALESCE(at, now_) AS t INTO nth FROM "public".k2b_rate_dispatch
     WHERE limit_key = p_key
       AND COALESCE(at, now_) > now_ - p_per_ms * interval '1 millisecond'
     ORDER BY t DESC OFFSET p_limit - 1 LIMIT 1;
    IF FOUND THEN
        -- Full: the window frees when the limit-th latest dispatch leaves it.
        free_at := nth + p_per_ms * interval '1 millisecond';
        RETURN;
    END IF;
    INSERT INTO "public".k2b_rate_dispatch
        (limit_key, at, reserved_at, run_id, seq, generation, window_ms)
    VALUES (p_key, NULL, now_, p_run, p_seq, p_generation, p_per_ms)
    RETURNING id INTO dispatch_id;
END;
$$;

CREATE OR REPLACE FUNCTION k2b_rate_stamp(p_id bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
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

#: Backwards: migration 0016's functions as it wrote them (invoker, a limit argument).
BACKWARD_SQL = (
    importlib.import_module("k2b_workflows.migrations.0016_flow_control").FUNCTIONS_SQL
    + "DROP FUNCTION IF EXISTS k2b_flow_admit(text, text);"
)

#: After the triggers stop calling it.
DROP_OLD_ADMIT_SQL = "DROP FUNCTION IF EXISTS k2b_flow_admit(text, text, integer);"


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0020_sealed_schedules_and_clock"),
    ]

    operations = [
        migrations.AddField(
            model_name="ratedispatch",
            name="window_ms",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(
                condition=models.Q(
                    ("concurrency_key__isnull", False), ("holds_slot", False), ("status", "queued")
                ),
                fields=["run_after"],
                name="k2b_run_delayed_keyed",
            ),
        ),
        migrations.RunSQL(FUNCTIONS_SQL, BACKWARD_SQL),
        pgtrigger.migrations.RemoveTrigger(
            model_name="workflowrun",
            name="slot_release",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="workflowrun",
            name="slot_admit_insert",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="workflowrun",
            name="slot_admit_update",
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="slot_release",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition="WHEN (OLD.\"holds_slot\" AND NEW.\"status\" IN ('succeeded', 'failed', 'canceled'))",
                    func='IF NEW.lease_expires_at IS NULL OR NEW.lease_expires_at <= "public".k2b_now() THEN NEW.holds_slot := false; END IF; RETURN NEW;',
                    hash="efc513977199a871fa1364db15b5569abbf7b58c",
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
                name="slot_never_inserted",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition='WHEN (NEW."holds_slot")',
                    func="RAISE EXCEPTION 'k2b_workflows: a run is inserted without a slot (admission gives it one)' USING ERRCODE = 'insufficient_privilege';",
                    hash="69676e19735e9baf0ef869241cb971e21b3b0752",
                    operation="INSERT",
                    pgid="pgtrigger_slot_never_inserted_bc090",
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
                    func='PERFORM "public".k2b_flow_admit(NEW.workflow_name, NEW.concurrency_key); RETURN NULL;',
                    hash="6dddc24d931cdef0086e879154391f5798e1e971",
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
                    func='PERFORM "public".k2b_flow_admit(NEW.workflow_name, NEW.concurrency_key); RETURN NULL;',
                    hash="3751594740f9e6b8b6f3106e4fa1b67017f4107f",
                    operation="UPDATE",
                    pgid="pgtrigger_slot_admit_update_26d1b",
                    table="k2b_run",
                    when="AFTER",
                ),
            ),
        ),
        migrations.RunSQL(DROP_OLD_ADMIT_SQL, migrations.RunSQL.noop),
    ]
