"""Drop the run's own index on ``parent_id`` (#13).

``k2b_run_child_once`` (parent_id, parent_step, child_index), partial on
``parent_id IS NOT NULL``, serves every lookup by parent (a child's steps, the
foreign key's checks when a run is deleted). The full index held an entry for
every run, most of them NULL, and cost an index insert at each enqueue and
each status change (a claim, a park, an end). Dropped concurrently, as 0012
did, so a rolling deploy is not blocked; the foreign key stays as it is.
"""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("k2b_workflows", "0012_evidence_run_indexes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="workflowrun",
                    name="parent",
                    field=models.ForeignKey(
                        blank=True,
                        db_index=False,
                        null=True,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="children",
                        to="k2b_workflows.workflowrun",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    'DROP INDEX CONCURRENTLY IF EXISTS "k2b_run_parent_id_45ac750a"',
                    reverse_sql='CREATE INDEX CONCURRENTLY IF NOT EXISTS "k2b_run_parent_id_45ac750a"'
                    ' ON "k2b_run" ("parent_id")',
                ),
            ],
        ),
    ]
