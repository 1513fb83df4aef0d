"""An ended run's slot goes when its holder is gone or says it left run(), not when a lease says so.

The failure (#47): a run canceled while its worker was inside ``run()`` kept its
slot while its lease was live, and the runtime role rewrote that lease: the
next run of a limit-1 key entered the provider beside the canceled one. The
release now asks the holder's presence lock (``kernel/holders.py``), which only
the holder's own session, or its end, lets go of.
"""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations

import k2b_workflows.triggers


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0027_attempts_and_limits_sealed"),
    ]

    operations = [
        pgtrigger.migrations.RemoveTrigger(
            model_name="workflowrun",
            name="slot_release",
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="slot_release",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition="WHEN (OLD.\"holds_slot\" AND NEW.\"status\" IN ('succeeded', 'failed', 'canceled'))",
                    func="IF OLD.status IN ('succeeded', 'failed', 'canceled') AND NEW.claimed_by IS DISTINCT FROM OLD.claimed_by THEN RAISE EXCEPTION 'k2b_workflows: the holder of an ended run that holds a slot never changes' USING ERRCODE = 'insufficient_privilege'; END IF; IF NEW.lease_expires_at IS NULL AND OLD.status NOT IN ('succeeded', 'failed', 'canceled') THEN NEW.holds_slot := false; ELSIF (NEW.lease_expires_at IS NULL OR NEW.lease_expires_at <= \"public\".k2b_now()) AND (OLD.claimed_by = '' OR pg_catalog.pg_try_advisory_xact_lock(pg_catalog.hashtextextended('k2b.worker:' || OLD.claimed_by, 0))) THEN NEW.holds_slot := false; END IF; RETURN NEW;",
                    hash="862acf0dc7b0a7ce3e873e9f77f4ac91f0afaae8",
                    operation="UPDATE",
                    pgid="pgtrigger_slot_release_85e07",
                    table="k2b_run",
                    when="BEFORE",
                ),
            ),
        ),
    ]
