"""A run's end announces itself, and a run may time out (#26).

``notify_ended``: ``pg_notify('k2b_run_ended', id)`` when a run becomes
succeeded, failed, canceled or needs_attention, in the transaction that ends
it, for ``wait_for_workflow_run``. ``timeout_at``: when a run of a workflow
with a ``timeout`` is canceled if it has not ended, with the partial index
the sweep walks.
"""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0013_run_parent_index"),
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
                sql=pgtrigger.compiler.UpsertTriggerSql(
                    condition="WHEN (NEW.\"status\" IN ('succeeded', 'failed', 'canceled', 'needs_attention') AND OLD.\"status\" IS DISTINCT FROM (NEW.\"status\"))",
                    func="PERFORM pg_notify('k2b_run_ended', NEW.id::text); RETURN NULL;",
                    hash="a1351026bea9b41928b1dd11e2005780fb6c8914",
                    operation="UPDATE",
                    pgid="pgtrigger_notify_ended_4dc7a",
                    table="k2b_run",
                    when="AFTER",
                ),
            ),
        ),
    ]
