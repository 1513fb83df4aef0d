"""Forks (#50): a run's ``forked_from``, its forks' index, the "forked" ledger kind.

``forked_from`` links a fork to the run it was forked from; the partial index
``k2b_run_forks`` lists a run's forks and costs runs that are no fork nothing.
The permission ``fork_workflowrun`` guards the admin's "Fork from this step".
"""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0031_progress"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="workflowrun",
            options={
                "ordering": ["-created_at"],
                "permissions": [
                    ("resolve_effect", "Can resolve an ambiguous effect"),
                    ("cancel_workflowrun", "Can cancel a workflow run"),
                    ("retry_workflowrun", "Can retry a failed workflow run"),
                    ("fork_workflowrun", "Can fork a workflow run from a step"),
                    ("dry_run_workflow", "Can dry-run a workflow from the admin"),
                ],
            },
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="forked_from",
            field=models.ForeignKey(
                blank=True,
                db_index=False,
                editable=False,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="forks",
                to="k2b_workflows.workflowrun",
            ),
        ),
        migrations.AlterField(
            model_name="ledgerentry",
            name="kind",
            field=models.CharField(
                choices=[
                    ("dispatched", "Dispatched"),
                    ("succeeded", "Succeeded"),
                    ("failed", "Failed"),
                    ("outcome_unknown", "Outcome Unknown"),
                    ("reconciled", "Reconciled"),
                    ("reconcile_unknown", "Reconcile Unknown"),
                    ("pending", "Pending"),
                    ("late_result", "Late Result"),
                    ("resolved_confirmed", "Resolved Confirmed"),
                    ("resolved_absent", "Resolved Absent"),
                    ("rejected", "Rejected"),
                    ("canceled", "Canceled"),
                    ("retried", "Retried"),
                    ("forked", "Forked"),
                ],
                max_length=30,
            ),
        ),
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(
                condition=models.Q(("forked_from__isnull", False)),
                fields=["forked_from"],
                name="k2b_run_forks",
            ),
        ),
    ]
