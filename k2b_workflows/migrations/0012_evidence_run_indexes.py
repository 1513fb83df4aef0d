"""Drop the journal's and the ledger's own indexes on ``run_id`` (#13).

Each was a prefix of a composite index that serves every lookup by run
(``k2b_journal_step_once`` on (run_id, seq), ``k2b_ledger_step`` on
(run_id, seq)), and cost one more index insert per step. Only the indexes
go, concurrently, so a rolling deploy is not blocked; the foreign keys stay as
they are (Django's own AlterField would drop and re-validate them, a scan of
each table under lock).
"""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("k2b_workflows", "0011_status_trigger_on_change"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="journalentry",
                    name="run",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="journal",
                        to="k2b_workflows.workflowrun",
                    ),
                ),
                migrations.AlterField(
                    model_name="ledgerentry",
                    name="run",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="ledger",
                        to="k2b_workflows.workflowrun",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    'DROP INDEX CONCURRENTLY IF EXISTS "k2b_journal_run_id_73905d41"',
                    reverse_sql='CREATE INDEX CONCURRENTLY IF NOT EXISTS "k2b_journal_run_id_73905d41"'
                    ' ON "k2b_journal" ("run_id")',
                ),
                migrations.RunSQL(
                    'DROP INDEX CONCURRENTLY IF EXISTS "k2b_ledger_run_id_972d40d8"',
                    reverse_sql='CREATE INDEX CONCURRENTLY IF NOT EXISTS "k2b_ledger_run_id_972d40d8"'
                    ' ON "k2b_ledger" ("run_id")',
                ),
            ],
        ),
    ]
