"""The workers whose lease on a run expired, in order (#37).

A task's ``TaskResult.worker_ids`` names one worker per attempt; an attempt
whose worker died left no trace of that worker once the reap cleared
``claimed_by``. The reap now appends it here. Nullable: a row written by an
older release's code, or before this column, simply has none.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0024_journal_length"),
    ]

    operations = [
        migrations.AddField(
            model_name="workflowrun",
            name="lease_lost_by",
            field=models.JSONField(blank=True, editable=False, null=True),
        ),
    ]
