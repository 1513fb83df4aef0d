"""Run progress (#49): one row per run, upserted by the progress writer on its own connection.

Not a foreign key to ``k2b_run``: the key's check would lock the run row at
every progress write, the row every step fences. Retention deletes a run's
progress with it. The runtime role may write it (display only, see roles.py).
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0030_run_task_path_index"),
    ]

    operations = [
        migrations.CreateModel(
            name="RunProgress",
            fields=[
                ("run_id", models.UUIDField(primary_key=True, serialize=False)),
                ("generation", models.BigIntegerField()),
                ("done", models.BigIntegerField()),
                ("total", models.BigIntegerField(blank=True, null=True)),
                ("note", models.CharField(blank=True, default="", max_length=500)),
                ("updated_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "run progress",
                "verbose_name_plural": "run progress",
                "db_table": "k2b_progress",
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(("done__gte", 0)), name="k2b_progress_done_not_negative"
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            ("total__isnull", True),
                            ("total__gte", models.F("done")),
                            _connector="OR",
                        ),
                        name="k2b_progress_total_not_below_done",
                    ),
                ],
            },
        ),
    ]
