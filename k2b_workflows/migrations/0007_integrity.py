"""Keyed chains and anchors (#9); TRUNCATE refused on the append-only tables.

Existing entries are not touched (they keep ``key_id = ''``, unkeyed SHA-256,
and still verify); existing runs get keyed anchors over their chains as they
are now, so that from here on a deleted tail is detected on old runs too.
Run it with the ``EVIDENCE_KEYS`` (or ``SECRET_KEY``) the workers use.
"""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

# Copied here, not imported: a migration keeps the SQL it ran.
OWNER_ONLY_IGNORE_SQL = """
CREATE OR REPLACE FUNCTION "public"._k2b_refuse_foreign_ignore(trigger_name NAME, tbl OID)
RETURNS BOOLEAN AS $$
BEGIN
    IF trigger_name = ANY(NULLIF(current_setting('pgtrigger.ignore', true), '')::text[])
       AND NOT pg_has_role(current_user, (SELECT relowner FROM pg_class WHERE oid = tbl), 'MEMBER')
    THEN
        RAISE EXCEPTION 'k2b_workflows: only the owner of % may ignore %', tbl::regclass,
            trigger_name USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN TRUE;
END;
$$ LANGUAGE plpgsql STABLE;
"""


def anchor_existing_runs(apps, schema_editor):
    from k2b_workflows.kernel.evidence import GENESIS, anchor, signing_key

    key_id, key = signing_key()
    with schema_editor.connection.cursor() as cursor:
        for chain, table, order in (
            ("journal", "k2b_journal", "seq"),
            ("ledger", "k2b_ledger", "id"),
        ):
            cursor.execute(
                f"""SELECT r.id, count(e.id), (array_agg(e.entry_hash ORDER BY e.{order} DESC))[1]
                      FROM k2b_run r LEFT JOIN {table} e ON e.run_id = r.id GROUP BY r.id"""
            )
            seals = [
                (anchor(run_id, chain, count, head or GENESIS, key_id, key), run_id)
                for run_id, count, head in cursor.fetchall()
            ]
            cursor.executemany(f"UPDATE k2b_run SET {chain}_anchor = %s WHERE id = %s", seals)


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0005_worker"),
    ]

    operations = [
        migrations.AddField(
            model_name="journalentry",
            name="key_id",
            field=models.CharField(blank=True, default="", max_length=16),
        ),
        migrations.AddField(
            model_name="ledgerentry",
            name="key_id",
            field=models.CharField(blank=True, default="", max_length=16),
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="journal_anchor",
            field=models.CharField(blank=True, default="", editable=False, max_length=100),
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="ledger_anchor",
            field=models.CharField(blank=True, default="", editable=False, max_length=100),
        ),
        migrations.RunPython(anchor_existing_runs, migrations.RunPython.noop, elidable=True),
        pgtrigger.migrations.AddTrigger(
            model_name="budgetcharge",
            trigger=pgtrigger.compiler.Trigger(
                name="charge_no_truncate",
                sql=pgtrigger.compiler.UpsertTriggerSql(
                    func="RAISE EXCEPTION 'k2b_workflows: % is append-only, TRUNCATE is refused', TG_TABLE_NAME USING ERRCODE = 'insufficient_privilege';",
                    hash="9f0d42ca8cf8318066addf52ee8da5d401b1eaca",
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
                name="journal_no_truncate",
                sql=pgtrigger.compiler.UpsertTriggerSql(
                    func="RAISE EXCEPTION 'k2b_workflows: % is append-only, TRUNCATE is refused', TG_TABLE_NAME USING ERRCODE = 'insufficient_privilege';",
                    hash="660bd1835b2d39ec6c4d64947215d9a0dc015ec3",
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
                name="ledger_no_truncate",
                sql=pgtrigger.compiler.UpsertTriggerSql(
                    func="RAISE EXCEPTION 'k2b_workflows: % is append-only, TRUNCATE is refused', TG_TABLE_NAME USING ERRCODE = 'insufficient_privilege';",
                    hash="a6f8b4302abb66735ece29c8c95f922d3a8a5b1f",
                    level="STATEMENT",
                    operation="TRUNCATE",
                    pgid="pgtrigger_ledger_no_truncate_e07a1",
                    table="k2b_ledger",
                    when="BEFORE",
                ),
            ),
        ),
        migrations.RunSQL(OWNER_ONLY_IGNORE_SQL, elidable=False),
        pgtrigger.migrations.RemoveTrigger(
            model_name="aitask",
            name="ai_status_transitions",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="budgetcharge",
            name="charge_append_only",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="journalentry",
            name="journal_append_only",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="ledgerentry",
            name="ledger_append_only",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="workflowrun",
            name="status_transitions",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="workflowrun",
            name="generation_never_decreases",
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="aitask",
            trigger=pgtrigger.compiler.Trigger(
                name="ai_status_transitions",
                sql=pgtrigger.compiler.UpsertTriggerSql(
                    declare='DECLARE _is_valid_transition BOOLEAN; _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func='SELECT CONCAT(OLD."status", \':\', NEW."status") = ANY(\'{queued:running,queued:canceled,running:queued,running:succeeded,running:failed,running:canceled}\'::text[]) INTO _is_valid_transition; IF (_is_valid_transition IS FALSE AND OLD."status" IS DISTINCT FROM NEW."status") THEN RAISE EXCEPTION \'pgtrigger: Invalid transition of field "status" from "%" to "%" on table %\', OLD."status", NEW."status", TG_TABLE_NAME; ELSE RETURN NEW; END IF;',
                    hash="16ec4abbfe9c8ba4a54786214568be4164ce63ec",
                    operation="UPDATE",
                    pgid="pgtrigger_ai_status_transitions_0d3e8",
                    table="k2b_ai_task",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="budgetcharge",
            trigger=pgtrigger.compiler.Trigger(
                name="charge_append_only",
                sql=pgtrigger.compiler.UpsertTriggerSql(
                    declare='DECLARE _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;",
                    hash="3d57628ec627badb488fb8a73cb021a12a92f0ce",
                    operation="UPDATE OR DELETE",
                    pgid="pgtrigger_charge_append_only_c8f65",
                    table="k2b_budget_charge",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="journalentry",
            trigger=pgtrigger.compiler.Trigger(
                name="journal_append_only",
                sql=pgtrigger.compiler.UpsertTriggerSql(
                    declare='DECLARE _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;",
                    hash="ff3ef6edc39e66b40ddd499a3d65080053613119",
                    operation="UPDATE OR DELETE",
                    pgid="pgtrigger_journal_append_only_e9eb4",
                    table="k2b_journal",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="ledgerentry",
            trigger=pgtrigger.compiler.Trigger(
                name="ledger_append_only",
                sql=pgtrigger.compiler.UpsertTriggerSql(
                    declare='DECLARE _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;",
                    hash="19b88ceb2fc5533896d06c487ea552e4c50bd65e",
                    operation="UPDATE OR DELETE",
                    pgid="pgtrigger_ledger_append_only_13f4d",
                    table="k2b_ledger",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="status_transitions",
                sql=pgtrigger.compiler.UpsertTriggerSql(
                    declare='DECLARE _is_valid_transition BOOLEAN; _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func='SELECT CONCAT(OLD."status", \':\', NEW."status") = ANY(\'{queued:running,queued:canceled,running:queued,running:waiting,running:succeeded,running:failed,running:needs_attention,running:canceled,waiting:queued,waiting:canceled,needs_attention:queued,needs_attention:succeeded,needs_attention:canceled,failed:queued}\'::text[]) INTO _is_valid_transition; IF (_is_valid_transition IS FALSE AND OLD."status" IS DISTINCT FROM NEW."status") THEN RAISE EXCEPTION \'pgtrigger: Invalid transition of field "status" from "%" to "%" on table %\', OLD."status", NEW."status", TG_TABLE_NAME; ELSE RETURN NEW; END IF;',
                    hash="1a11bf442be65f1a7cccff99018770bad840c0a6",
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
                sql=pgtrigger.compiler.UpsertTriggerSql(
                    condition='WHEN (NEW."generation" < (OLD."generation"))',
                    declare='DECLARE _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func="RAISE EXCEPTION 'pgtrigger: Cannot update rows from % table', TG_TABLE_NAME;",
                    hash="5294ac116ccde729bb9d17ab54e917ec07670a16",
                    operation="UPDATE",
                    pgid="pgtrigger_generation_never_decreases_8473b",
                    table="k2b_run",
                    when="BEFORE",
                ),
            ),
        ),
    ]
