"""Paused queues, and the index of the Queues page (#49).

A pause is a row of ``k2b_queue_pause``, read by the claim statement itself:
it holds for every worker and through restarts and deploys.

``k2b_run_queue_status`` (queue, status, finished_at) lets the Queues page count
a queue's runs per status up to a cap, and what it finished in the last
minutes, without reading other queues' runs. Its cost: one more index entry per
run inserted, and per update that changes ``status`` (those are never HOT:
``status`` is indexed already); ``queue`` never changes, so updates that were
HOT stay HOT.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0028_slot_release_asks_the_holder"),
    ]

    operations = [
        migrations.CreateModel(
            name="QueuePause",
            fields=[
                ("queue", models.CharField(max_length=100, primary_key=True, serialize=False)),
                ("reason", models.TextField()),
                ("paused_by", models.CharField(blank=True, default="", max_length=150)),
                ("paused_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "queue",
                "verbose_name_plural": "queues",
                "db_table": "k2b_queue_pause",
                "ordering": ["queue"],
                "permissions": [("pause_queue", "Can pause and resume a queue")],
            },
        ),
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(
                fields=["queue", "status", "finished_at"], name="k2b_run_queue_status"
            ),
        ),
    ]
