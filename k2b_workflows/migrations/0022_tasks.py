"""django.tasks on the kernel (#37): the queue a task run was enqueued on, and its failed attempts.

``queue`` gets an index of its own in the claim's line order, so a worker
given ``runworkflows --queue`` walks only its queues' due runs. A task's
failed attempts (its ``TaskResult.errors``) are rows of ``k2b_task_attempt``.
"""

import django.db.models.deletion
from django.db import migrations, models

import k2b_workflows.models


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0023_notify_ended_when_waited"),
    ]

    operations = [
        migrations.CreateModel(
            name="TaskAttempt",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("attempt", models.PositiveIntegerField()),
                ("worker_id", models.CharField(blank=True, default="", max_length=200)),
                ("started_at", models.DateTimeField()),
                ("finished_at", models.DateTimeField()),
                ("exception_class_path", models.CharField(max_length=500)),
                ("traceback", models.TextField(blank=True, default="")),
                ("seal", models.CharField(blank=True, db_default="", default="", max_length=200)),
            ],
            options={
                "db_table": "k2b_task_attempt",
                "ordering": ["run", "id"],
            },
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="queue",
            field=models.CharField(db_default="default", default="default", max_length=100),
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="task_path",
            field=models.CharField(blank=True, db_default="", default="", max_length=200),
        ),
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(
                models.F("queue"),
                k2b_workflows.models.QueueOrder("run_after", "priority_credit_ms"),
                condition=models.Q(
                    ("status", "queued"),
                    models.Q(
                        ("concurrency_key__isnull", True), ("holds_slot", True), _connector="OR"
                    ),
                ),
                name="k2b_run_queued_queue",
            ),
        ),
        migrations.AddField(
            model_name="taskattempt",
            name="run",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.CASCADE,
                related_name="task_attempts",
                to="k2b_workflows.workflowrun",
            ),
        ),
    ]
