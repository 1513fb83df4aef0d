"""Keyed chains and anchors (#9); TRUNCATE refused on the append-only tables.

Existing entries are not touched (they keep ``key_id = ''``, unkeyed SHA-256,
and still verify); existing runs get keyed anchors over their chains as they
are now, so that from here on a deleted tail is detected on old runs too.
Run it with the ``EVIDENCE_KEYS`` (or ``SECRET_KEY``) the workers use.
"""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models


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
        ("k2b_workflows", "0004_dry_run_permission"),
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
    ]
