"""The index of the runs list's filter by task (#51).

``k2b_run_task_path`` (task_path, for task runs only) lets the admin list the
task paths runs carry by skipping from one path to the next (one index descent
per task, never a scan of the runs), and find one task's calls. Its cost: one
more index entry per task run inserted, and per update of a task run that
changes an indexed column (never HOT already); ``task_path`` never changes, so
updates that were HOT stay HOT. Workflow runs (an empty path) have no entry.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0029_queue_pause"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(
                condition=models.Q(("task_path", ""), _negated=True),
                fields=["task_path"],
                name="k2b_run_task_path",
            ),
        ),
    ]
