"""Lease renewals and step writes update a run row in place (HOT) (#13).

Every step fences its run: an UPDATE of ``lease_expires_at``, ``current_step``
and the journal anchor. With ``lease_expires_at`` indexed (``k2b_run_leased``)
no such update could be HOT, so each one added an entry to every index of
``k2b_run``; and the planner, seeing ``status = 'running'`` in the fence,
often walked that partial index (with the dead entries of those updates)
instead of the primary key. The running runs are now indexed by ``id``: the
fence finds its row in one probe, the reaper and the next-due query read the
few running rows through the same index, and a step's update changes no
indexed column. ``fillfactor = 80`` leaves room on each page for the new row
versions, which HOT needs (it applies to pages written from now on).

Built and dropped concurrently (so not in a transaction): the migration does
not block the workers of a rolling deploy.
"""

from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("k2b_workflows", "0009_k2b_now"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="workflowrun",
            index=models.Index(
                condition=models.Q(("status", "running")), fields=["id"], name="k2b_run_running"
            ),
        ),
        RemoveIndexConcurrently(model_name="workflowrun", name="k2b_run_leased"),
        migrations.RunSQL(
            "ALTER TABLE k2b_run SET (fillfactor = 80)",
            reverse_sql="ALTER TABLE k2b_run RESET (fillfactor)",
        ),
    ]
