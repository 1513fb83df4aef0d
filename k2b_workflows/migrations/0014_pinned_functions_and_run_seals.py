"""Every function of the app runs with a fixed ``search_path`` (#30).

A PL/pgSQL function resolves unqualified names through the caller's
``search_path``, where the session's temporary schema comes first: as the
runtime role, ``CREATE TEMP TABLE pg_class`` made the owner-only ignore check
read a table of the attacker's, and ``pgtrigger.ignore`` then switched off the
status and generation rules of ``k2b_run``. Each function is re-created with
``SET search_path = pg_catalog, pg_temp`` and schema-qualified names; the
triggers are re-installed through ``k2b_workflows.triggers.PinnedUpsertTriggerSql``,
which pins pgtrigger's functions the same way. One transaction: no update goes
unchecked in between.

The run row gets keyed seals over its own fields (``kernel/seals.py``): the
runtime role could change a queued run's input, or mark an incident
succeeded, and nothing noticed. Existing runs are sealed as they are now, as
0007 anchored their chains: run it with the ``EVIDENCE_KEYS`` (or
``SECRET_KEY``) the workers use.
"""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

import k2b_workflows.triggers

# Copied here, not imported: a migration keeps the SQL it ran.
OWNER_ONLY_IGNORE_SQL = """
CREATE OR REPLACE FUNCTION "public"._k2b_refuse_foreign_ignore(trigger_name NAME, tbl OID)
RETURNS BOOLEAN
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF trigger_name = ANY(
           NULLIF(pg_catalog.current_setting('pgtrigger.ignore', true), '')::text[])
       AND NOT pg_catalog.pg_has_role(
           current_user,
           (SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid = tbl),
           'MEMBER')
    THEN
        RAISE EXCEPTION 'k2b_workflows: only the owner of % may ignore %', tbl::regclass,
            trigger_name USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN TRUE;
END;
$$;
"""

K2B_NOW_SQL = """
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

# What 0009 created, for a migration back.
K2B_NOW_UNPINNED_SQL = """
CREATE OR REPLACE FUNCTION k2b_now() RETURNS timestamptz
LANGUAGE plpgsql STABLE PARALLEL SAFE COST 1
AS $$
BEGIN
    RETURN statement_timestamp()
           + coalesce(nullif(current_setting('k2b.clock_offset', true), ''), '0')::interval;
END;
$$;
"""


def seal_existing_runs(apps, schema_editor):
    from k2b_workflows.kernel.seals import SEALED_STATUSES, end_seal, start_seal
    from k2b_workflows.validation import CANONICAL_JSON

    WorkflowRun = apps.get_model("k2b_workflows", "WorkflowRun")
    db = schema_editor.connection.alias
    runs = WorkflowRun.objects.using(db).order_by("pk")
    with schema_editor.connection.cursor() as cursor:
        batch = []
        for run in runs.iterator(chunk_size=2000):
            ended = ""
            if run.status in SEALED_STATUSES:
                output = CANONICAL_JSON.encode(run.output)
                ended = end_seal(run.pk, run.status, run.error_code, run.generation, output)
            batch.append((start_seal(run), ended, run.pk))
            if len(batch) >= 2000:
                _write(cursor, batch)
                batch = []
        _write(cursor, batch)


def _write(cursor, batch):
    if batch:
        cursor.executemany("UPDATE k2b_run SET start_seal = %s, end_seal = %s WHERE id = %s", batch)


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0013_run_parent_index"),
    ]

    operations = [
        migrations.RunSQL(OWNER_ONLY_IGNORE_SQL, migrations.RunSQL.noop),
        migrations.RunSQL(K2B_NOW_SQL, K2B_NOW_UNPINNED_SQL),
        migrations.AddField(
            model_name="workflowrun",
            name="start_seal",
            field=models.CharField(blank=True, default="", editable=False, max_length=100),
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="end_seal",
            field=models.CharField(blank=True, default="", editable=False, max_length=100),
        ),
        migrations.RunPython(seal_existing_runs, migrations.RunPython.noop, elidable=True),
        pgtrigger.migrations.RemoveTrigger(
            model_name="aitask",
            name="notify_ai_queued",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="aitask",
            name="ai_status_transitions",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="budgetcharge",
            name="charge_no_truncate",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="budgetcharge",
            name="charge_append_only",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="journalentry",
            name="journal_no_truncate",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="journalentry",
            name="journal_append_only",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="ledgerentry",
            name="ledger_no_truncate",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="ledgerentry",
            name="ledger_append_only",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="workflowrun",
            name="notify_queued_insert",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="workflowrun",
            name="notify_queued_update",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="workflowrun",
            name="generation_never_decreases",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="workflowrun",
            name="status_transitions",
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="aitask",
            trigger=pgtrigger.compiler.Trigger(
                name="ai_status_transitions",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    declare='DECLARE _is_valid_transition BOOLEAN; _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func='SELECT CONCAT(OLD."status", \':\', NEW."status") = ANY(\'{queued:running,queued:canceled,running:queued,running:succeeded,running:failed,running:canceled}\'::text[]) INTO _is_valid_transition; IF (_is_valid_transition IS FALSE AND OLD."status" IS DISTINCT FROM NEW."status") THEN RAISE EXCEPTION \'pgtrigger: Invalid transition of field "status" from "%" to "%" on table %\', OLD."status", NEW."status", TG_TABLE_NAME; ELSE RETURN NEW; END IF;',
                    hash="0bb3c04e4bd39a85053f00c1b9b91a7298163814",
                    operation="UPDATE",
                    pgid="pgtrigger_ai_status_transitions_0d3e8",
                    table="k2b_ai_task",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="aitask",
            trigger=pgtrigger.compiler.Trigger(
                name="notify_ai_queued",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition="WHEN (NEW.\"status\" = 'queued')",
                    func="PERFORM pg_catalog.pg_notify('k2b_workflows', NEW.app_id); RETURN NULL;",
                    hash="b29bd928fdab2f8a5667cf9d7a258abe0ab4c816",
                    operation="INSERT OR UPDATE",
                    pgid="pgtrigger_notify_ai_queued_27b81",
                    table="k2b_ai_task",
                    when="AFTER",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="budgetcharge",
            trigger=pgtrigger.compiler.Trigger(
                name="charge_append_only",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    declare='DECLARE _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;",
                    hash="a41582f9ab55ccbee5adda80174b433b229c08ec",
                    operation="UPDATE OR DELETE",
                    pgid="pgtrigger_charge_append_only_c8f65",
                    table="k2b_budget_charge",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="budgetcharge",
            trigger=pgtrigger.compiler.Trigger(
                name="charge_no_truncate",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    func="RAISE EXCEPTION 'k2b_workflows: % is append-only, TRUNCATE is refused', TG_TABLE_NAME USING ERRCODE = 'insufficient_privilege';",
                    hash="d107c3ddce18ddb67f3ffdac7b6e417ebf266bd9",
                    level="STATEMENT",
                    operation="TRUNCATE",
                    pgid="pgtrigger_charge_no_truncate_3eec2",
                    table="k2b_budget_charge",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="journalentry",
            trigger=pgtrigger.compiler.Trigger(
                name="journal_append_only",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    declare='DECLARE _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;",
                    hash="5c9463696149acbfba11a2ac29d8713e3a89e95c",
                    operation="UPDATE OR DELETE",
                    pgid="pgtrigger_journal_append_only_e9eb4",
                    table="k2b_journal",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="journalentry",
            trigger=pgtrigger.compiler.Trigger(
                name="journal_no_truncate",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    func="RAISE EXCEPTION 'k2b_workflows: % is append-only, TRUNCATE is refused', TG_TABLE_NAME USING ERRCODE = 'insufficient_privilege';",
                    hash="0c4af782e93ff70eee03ea1fd60b613842ce9613",
                    level="STATEMENT",
                    operation="TRUNCATE",
                    pgid="pgtrigger_journal_no_truncate_e1be5",
                    table="k2b_journal",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="ledgerentry",
            trigger=pgtrigger.compiler.Trigger(
                name="ledger_append_only",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    declare='DECLARE _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;",
                    hash="e0a68aaa1d6a73bc07bfe4cdc8a988d18bb2fbdc",
                    operation="UPDATE OR DELETE",
                    pgid="pgtrigger_ledger_append_only_13f4d",
                    table="k2b_ledger",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="ledgerentry",
            trigger=pgtrigger.compiler.Trigger(
                name="ledger_no_truncate",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    func="RAISE EXCEPTION 'k2b_workflows: % is append-only, TRUNCATE is refused', TG_TABLE_NAME USING ERRCODE = 'insufficient_privilege';",
                    hash="29c48735b7147209b3e9b4b4f3b6d3d9e052c483",
                    level="STATEMENT",
                    operation="TRUNCATE",
                    pgid="pgtrigger_ledger_no_truncate_e07a1",
                    table="k2b_ledger",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="status_transitions",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition='WHEN (OLD."status" IS DISTINCT FROM (NEW."status"))',
                    declare='DECLARE _is_valid_transition BOOLEAN; _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func='SELECT CONCAT(OLD."status", \':\', NEW."status") = ANY(\'{queued:running,queued:canceled,running:queued,running:waiting,running:succeeded,running:failed,running:needs_attention,running:canceled,waiting:queued,waiting:canceled,needs_attention:queued,needs_attention:succeeded,needs_attention:canceled,failed:queued}\'::text[]) INTO _is_valid_transition; IF (_is_valid_transition IS FALSE AND OLD."status" IS DISTINCT FROM NEW."status") THEN RAISE EXCEPTION \'pgtrigger: Invalid transition of field "status" from "%" to "%" on table %\', OLD."status", NEW."status", TG_TABLE_NAME; ELSE RETURN NEW; END IF;',
                    hash="3ade09c2573faa1b965ebb3f3b34564ebb88bad0",
                    operation="UPDATE",
                    pgid="pgtrigger_status_transitions_60e15",
                    table="k2b_run",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="generation_never_decreases",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition='WHEN (NEW."generation" < (OLD."generation"))',
                    declare='DECLARE _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func="RAISE EXCEPTION 'pgtrigger: Cannot update rows from % table', TG_TABLE_NAME;",
                    hash="180bff4fae27b3a11b5adead52c85ab3164ca9a0",
                    operation="UPDATE",
                    pgid="pgtrigger_generation_never_decreases_8473b",
                    table="k2b_run",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="notify_queued_insert",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition="WHEN (NEW.\"status\" = 'queued')",
                    func="PERFORM pg_catalog.pg_notify('k2b_workflows', NEW.app_id); RETURN NULL;",
                    hash="5c1e57277dab210c04ea2e7a1926cc751cdd1245",
                    operation="INSERT",
                    pgid="pgtrigger_notify_queued_insert_e9872",
                    table="k2b_run",
                    when="AFTER",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="notify_queued_update",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition='WHEN (NEW."status" = \'queued\' AND (OLD."status" IS DISTINCT FROM (NEW."status") OR OLD."run_after" IS DISTINCT FROM (NEW."run_after")))',
                    func="PERFORM pg_catalog.pg_notify('k2b_workflows', NEW.app_id); RETURN NULL;",
                    hash="b3de26ee1e8dca652b04b63c50370e2a8c227c42",
                    operation="UPDATE",
                    pgid="pgtrigger_notify_queued_update_63ef7",
                    table="k2b_run",
                    when="AFTER",
                ),
            ),
        ),
    ]
