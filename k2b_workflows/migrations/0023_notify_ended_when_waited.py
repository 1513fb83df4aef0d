"""A run's end notifies only when someone waits for it (#39).

The failure: every NOTIFY wakes each backend that LISTENs in the database (every
worker's, whatever its channel), which runs a transaction to read the queue, and
the notifying commit takes the server's notify lock. ``notify_ended`` fired for
every run: a worker draining a backlog paid one more commit and a backend's
wake-up per run, for runs nobody waited on. Now it notifies when a waiter holds
its run's advisory lock (``triggers.NotifyEnded``, ``results.py``).
"""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations

import k2b_workflows.triggers


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0015_schedules"),
    ]

    operations = [
        pgtrigger.migrations.RemoveTrigger(
            model_name="workflowrun",
            name="notify_ended",
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="notify_ended",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition="WHEN (NEW.\"status\" IN ('succeeded', 'failed', 'canceled', 'needs_attention') AND OLD.\"status\" IS DISTINCT FROM (NEW.\"status\"))",
                    func="IF NOT pg_catalog.pg_try_advisory_xact_lock(pg_catalog.hashtextextended('k2b.result:' || NEW.id::text, 0)) THEN PERFORM pg_catalog.pg_notify('k2b_run_ended', NEW.id::text); END IF; RETURN NULL;",
                    hash="0685c56239145436b86a65bed123f85545a57b62",
                    operation="UPDATE",
                    pgid="pgtrigger_notify_ended_4dc7a",
                    table="k2b_run",
                    when="AFTER",
                ),
            ),
        ),
    ]
