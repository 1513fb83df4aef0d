"""The run's trace context, an index of finished runs, the overview's rollup (#28).

``trace_context`` (nullable, no default: adding it rewrites nothing) holds
the W3C trace context of the code that started the run, so a worker on
another host continues that trace. ``k2b_run_finished`` on ``finished_at``,
covering ``status`` and ``error_code``, lets the admin's overview count
what finished per minute and which codes failed with an index-only scan of
the window, never the whole table; it is built concurrently so that a
rolling deploy is not blocked. ``k2b_overview_minute`` holds the
overview's counts of minutes that are over.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("k2b_workflows", "0016_flow_control"),
    ]

    operations = [
        migrations.CreateModel(
            name="OverviewMinute",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("minute", models.DateTimeField()),
                (
                    "kind",
                    models.CharField(
                        choices=[
                            ("started", "Started"),
                            ("finished", "Finished"),
                            ("rolled", "Rolled"),
                        ],
                        max_length=10,
                    ),
                ),
                ("status", models.CharField(blank=True, default="", max_length=20)),
                ("error_code", models.CharField(blank=True, default="", max_length=100)),
                ("count", models.BigIntegerField()),
            ],
            options={
                "db_table": "k2b_overview_minute",
                "constraints": [
                    models.UniqueConstraint(
                        fields=("minute", "kind", "status", "error_code"),
                        name="k2b_overview_minute_once",
                    )
                ],
            },
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="trace_context",
            field=models.JSONField(blank=True, editable=False, null=True),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="workflowrun",
                    index=models.Index(
                        condition=models.Q(("finished_at__isnull", False)),
                        fields=["finished_at"],
                        include=("status", "error_code"),
                        name="k2b_run_finished",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    'CREATE INDEX CONCURRENTLY IF NOT EXISTS "k2b_run_finished" ON "k2b_run"'
                    ' ("finished_at") INCLUDE ("status", "error_code")'
                    ' WHERE "finished_at" IS NOT NULL',
                    reverse_sql='DROP INDEX CONCURRENTLY IF EXISTS "k2b_run_finished"',
                ),
            ],
        ),
    ]
