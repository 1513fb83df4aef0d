"""A task call's cancel request (#49).

``k2b_run.cancel_requested_at``: when ``tasks.cancel`` asked the running call
of a task run to stop, and ``cancel_reason``, why. The worker's lease keeper reads it for the runs it
holds, and a claim of a run that carries it ends the run canceled without
calling the task again. Nullable, or with a database default: adding them rewrites nothing.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0033_unique"),
    ]

    operations = [
        migrations.AddField(
            model_name="workflowrun",
            name="cancel_requested_at",
            field=models.DateTimeField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="cancel_reason",
            field=models.TextField(blank=True, db_default="", default="", editable=False),
        ),
    ]
