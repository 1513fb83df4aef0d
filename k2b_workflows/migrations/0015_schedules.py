"""Schedules (#24): the schedule table, its skipped ticks, and the run's schedule columns.

The run's two indexes are partial on ``schedule_id IS NOT NULL`` (runs started
otherwise have no entry) and built concurrently, as 0012 did, so a deploy
does not block writes to ``k2b_run`` while they are built.
"""

import django.db.models.deletion
import django.utils.timezone
from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("k2b_workflows", "0017_run_results_and_timeouts"),
    ]

    operations = [
        migrations.CreateModel(
            name="WorkflowSchedule",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("schedule_id", models.CharField(max_length=200, unique=True)),
                ("workflow_name", models.CharField(max_length=200)),
                ("workflow_version", models.PositiveIntegerField(blank=True, null=True)),
                ("cron", models.CharField(blank=True, default="", max_length=200)),
                ("every", models.DurationField(blank=True, null=True)),
                ("timezone", models.CharField(default="UTC", max_length=64)),
                ("input", models.JSONField(blank=True, default=dict)),
                (
                    "catch_up",
                    models.CharField(
                        choices=[("skip", "Skip"), ("latest", "Latest"), ("all", "All")],
                        default="latest",
                        max_length=10,
                    ),
                ),
                (
                    "overlap",
                    models.CharField(
                        choices=[
                            ("skip", "Skip"),
                            ("allow", "Allow"),
                            ("buffer_one", "buffer one"),
                        ],
                        default="skip",
                        max_length=12,
                    ),
                ),
                ("jitter", models.DurationField(blank=True, null=True)),
                ("paused", models.BooleanField(default=False)),
                (
                    "source",
                    models.CharField(
                        choices=[("decorator", "Decorator"), ("code", "Code"), ("admin", "Admin")],
                        default="code",
                        max_length=10,
                    ),
                ),
                ("enabled", models.BooleanField(default=True)),
                ("disabled_reason", models.CharField(blank=True, default="", max_length=300)),
                ("anchor", models.DateTimeField(default=django.utils.timezone.now)),
                ("next_tick", models.DateTimeField(blank=True, null=True)),
                ("next_fire_at", models.DateTimeField(blank=True, null=True)),
                ("last_tick", models.DateTimeField(blank=True, null=True)),
                ("last_run_id", models.UUIDField(blank=True, null=True)),
                ("buffered_tick", models.DateTimeField(blank=True, null=True)),
                ("resumed_at", models.DateTimeField(blank=True, null=True)),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("updated_at", models.DateTimeField(default=django.utils.timezone.now)),
            ],
            options={
                "db_table": "k2b_schedule",
                "ordering": ["schedule_id"],
                "permissions": [
                    ("pause_workflowschedule", "Can pause and resume a workflow schedule"),
                    ("run_workflowschedule", "Can run a workflow schedule now"),
                ],
            },
        ),
        migrations.CreateModel(
            name="WorkflowScheduleSkip",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("first_tick", models.DateTimeField()),
                ("last_tick", models.DateTimeField()),
                ("count", models.PositiveIntegerField(default=1)),
                (
                    "reason",
                    models.CharField(
                        choices=[
                            ("catch_up", "missed (catch_up)"),
                            ("overlap", "previous run not ended (overlap)"),
                            ("buffer_full", "a tick was already buffered (buffer_one)"),
                        ],
                        max_length=20,
                    ),
                ),
                ("recorded_at", models.DateTimeField(default=django.utils.timezone.now)),
            ],
            options={
                "db_table": "k2b_schedule_skip",
                "ordering": ["-recorded_at", "-id"],
            },
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="schedule_id",
            field=models.CharField(blank=True, max_length=200, null=True),
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="scheduled_for",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddIndex(
            model_name="workflowschedule",
            index=models.Index(
                condition=models.Q(("enabled", True), ("paused", False)),
                fields=["next_fire_at"],
                name="k2b_schedule_due",
            ),
        ),
        migrations.AddIndex(
            model_name="workflowschedule",
            index=models.Index(
                condition=models.Q(
                    ("buffered_tick__isnull", False), ("enabled", True), ("paused", False)
                ),
                fields=["buffered_tick"],
                name="k2b_schedule_buffered",
            ),
        ),
        migrations.AddField(
            model_name="workflowscheduleskip",
            name="schedule",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.CASCADE,
                related_name="skips",
                to="k2b_workflows.workflowschedule",
            ),
        ),
        AddIndexConcurrently(
            model_name="workflowrun",
            index=models.Index(
                condition=models.Q(("schedule_id__isnull", False)),
                fields=["schedule_id", "scheduled_for"],
                name="k2b_run_schedule",
            ),
        ),
        AddIndexConcurrently(
            model_name="workflowrun",
            index=models.Index(
                condition=models.Q(
                    ("schedule_id__isnull", False),
                    ("status__in", ["queued", "running", "waiting", "needs_attention"]),
                ),
                fields=["schedule_id"],
                name="k2b_run_schedule_active",
            ),
        ),
    ]
