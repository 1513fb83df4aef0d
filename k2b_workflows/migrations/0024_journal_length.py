"""The run row keeps its journal's length, so an append checks it without a count (#39).

Each journal append (and a run's end) matched only when
``(SELECT count(*) FROM k2b_journal WHERE run_id = ...)`` was the entry's step:
the server counted every entry of the run for every append. The length now
lives on the run row, set by the statement that appends and seals the anchor,
and compared on the row that statement locks. Existing runs get the count of
their entries.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0021_flow_guards"),
    ]

    operations = [
        migrations.AddField(
            model_name="workflowrun",
            name="journal_length",
            field=models.IntegerField(db_default=0, default=0, editable=False),
        ),
        migrations.RunSQL(
            """
            UPDATE k2b_run r SET journal_length = j.n
              FROM (SELECT run_id, count(*) AS n FROM k2b_journal GROUP BY run_id) j
             WHERE r.id = j.run_id
            """,
            migrations.RunSQL.noop,
        ),
    ]
