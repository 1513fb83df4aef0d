"""A run's end announces itself, and a run may time out (#26).

``notify_ended``: ``pg_notify('k2b_run_ended', id)`` when a run becomes
succeeded, failed, canceled or needs_attention, in the transaction that ends
it, for ``wait_for_workflow_run`` (pinned like every trigger of the app).
``timeout_at``: when a run of a workflow with a ``timeout`` is canceled if it
has not ended, with the partial index the sweep walks.
"""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

import k2b_workflows.triggers


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0019_wait_action"),
    ]

    operations = [
        migrations.AddField(
            model_name="workflowrun",
            name="timeout_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(
                condition=models.Q(
                    ("status__in", ["queued", "running", "waiting"]), ("timeout_at__isnull", False)
                ),
                fields=["timeout_at"],
                name="k2b_run_timeout",
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="notify_ended",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition="WHEN (NEW.\"status\" IN ('succeeded', 'failed', 'canceled', 'needs_attention') AND OLD.\"status\" IS DISTINCT FROM (NEW.\"status\"))",
                    func="PERFORM pg_catalog.pg_notify('k2b_run_ended', NEW.id::text); RETURN NULL;",
                    hash="35a0f5d0ff9144a9f58cc91ff2db86df194c3bab",
                    operation="UPDATE",
                    pgid="pgtrigger_notify_ended_4dc7a",
                    table="k2b_run",
                    when="AFTER",
                ),
            ),
        ),
    ]
