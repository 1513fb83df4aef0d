"""The unique keys of runs (#49): ``Unique`` on a task or a workflow.

``unique_key`` (a hash of the task path or workflow name and the key's
arguments) and ``unique_states`` (where the run holds it) on the run, and
``k2b_run_unique_key``, a partial unique index over the runs that hold their
key. Existing runs have no key: the index starts empty and its build reads
the table once. Its cost on runs without a key: none in the index; an update
that changes ``generation`` (a claim, a takeover) is no longer HOT, as one
that changes ``status`` already was not.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0032_fork"),
    ]

    operations = [
        migrations.AddField(
            model_name="workflowrun",
            name="unique_key",
            field=models.CharField(blank=True, editable=False, max_length=64, null=True),
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="unique_states",
            field=models.SmallIntegerField(db_default=0, default=0, editable=False),
        ),
        migrations.AddConstraint(
            model_name="workflowrun",
            constraint=models.UniqueConstraint(
                condition=models.Q(
                    ("unique_key__isnull", False),
                    models.Q(
                        models.Q(("generation", 0), ("status", "queued")),
                        models.Q(
                            ("unique_states__gte", 2),
                            models.Q(
                                ("status__in", ["running", "waiting", "needs_attention"]),
                                models.Q(("generation__gt", 0), ("status", "queued")),
                                _connector="OR",
                            ),
                        ),
                        models.Q(("status", "succeeded"), ("unique_states__in", [3, 5])),
                        models.Q(
                            ("status__in", ["failed", "canceled"]), ("unique_states__in", [4, 5])
                        ),
                        _connector="OR",
                    ),
                ),
                fields=("unique_key",),
                name="k2b_run_unique_key",
            ),
        ),
    ]
