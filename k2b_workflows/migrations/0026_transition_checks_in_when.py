"""Transition checks and the end's notification decided in the triggers' WHEN clauses.

The failure: a claim and an end each change a run's status, and each change
called the status trigger's PL/pgSQL function (with the owner-only ignore check
and pgtrigger's ignore check inside it), and each end called ``notify_ended``'s to
try a waiter's lock. Three to five PL/pgSQL calls per task, each setting and
restoring its pinned ``search_path``: about 120 µs of the server's CPU per no-op
task, a quarter of it. The allowed transitions and the lock are now in the
``WHEN`` clauses; the functions run only for a refused transition or a run
someone waits on (``triggers.GuardedFSM``, ``triggers.NotifyEnded``).
"""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations

import k2b_workflows.triggers


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0025_lease_lost_by"),
    ]

    operations = [
        pgtrigger.migrations.RemoveTrigger(
            model_name="aitask",
            name="ai_status_transitions",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="workflowrun",
            name="status_transitions",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name="workflowrun",
            name="notify_ended",
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="aitask",
            trigger=pgtrigger.compiler.Trigger(
                name="ai_status_transitions",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition='WHEN (OLD."status" IS DISTINCT FROM NEW."status" AND NOT (pg_catalog.concat(OLD."status", \':\', NEW."status") = ANY(\'{queued:running,queued:canceled,running:queued,running:succeeded,running:failed,running:canceled}\'::text[])))',
                    declare='DECLARE _is_valid_transition BOOLEAN; _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func='SELECT CONCAT(OLD."status", \':\', NEW."status") = ANY(\'{queued:running,queued:canceled,running:queued,running:succeeded,running:failed,running:canceled}\'::text[]) INTO _is_valid_transition; IF (_is_valid_transition IS FALSE AND OLD."status" IS DISTINCT FROM NEW."status") THEN RAISE EXCEPTION \'pgtrigger: Invalid transition of field "status" from "%" to "%" on table %\', OLD."status", NEW."status", TG_TABLE_NAME; ELSE RETURN NEW; END IF;',
                    hash="1819148cbfc32667b21e8739fd7f343be6fe335b",
                    operation="UPDATE",
                    pgid="pgtrigger_ai_status_transitions_0d3e8",
                    table="k2b_ai_task",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="status_transitions",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition='WHEN (OLD."status" IS DISTINCT FROM NEW."status" AND NOT (pg_catalog.concat(OLD."status", \':\', NEW."status") = ANY(\'{queued:running,queued:canceled,running:queued,running:waiting,running:succeeded,running:failed,running:needs_attention,running:canceled,waiting:queued,waiting:canceled,needs_attention:queued,needs_attention:succeeded,needs_attention:canceled,failed:queued}\'::text[])))',
                    declare='DECLARE _is_valid_transition BOOLEAN; _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func='SELECT CONCAT(OLD."status", \':\', NEW."status") = ANY(\'{queued:running,queued:canceled,running:queued,running:waiting,running:succeeded,running:failed,running:needs_attention,running:canceled,waiting:queued,waiting:canceled,needs_attention:queued,needs_attention:succeeded,needs_attention:canceled,failed:queued}\'::text[]) INTO _is_valid_transition; IF (_is_valid_transition IS FALSE AND OLD."status" IS DISTINCT FROM NEW."status") THEN RAISE EXCEPTION \'pgtrigger: Invalid transition of field "status" from "%" to "%" on table %\', OLD."status", NEW."status", TG_TABLE_NAME; ELSE RETURN NEW; END IF;',
                    hash="227be68b7c2fc544f30ee1145e3b0054e3dbd5fd",
                    operation="UPDATE",
                    pgid="pgtrigger_status_transitions_60e15",
                    table="k2b_run",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="notify_ended",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition="WHEN (CASE WHEN (NEW.\"status\" IN ('succeeded', 'failed', 'canceled', 'needs_attention') AND OLD.\"status\" IS DISTINCT FROM (NEW.\"status\")) THEN NOT pg_catalog.pg_try_advisory_xact_lock(pg_catalog.hashtextextended('k2b.result:' || NEW.id::text, 0)) ELSE FALSE END)",
                    func="PERFORM pg_catalog.pg_notify('k2b_run_ended', NEW.id::text); RETURN NULL;",
                    hash="3a8fe8789fa3fcccc1a2b3db34368564b48e0a9f",
                    operation="UPDATE",
                    pgid="pgtrigger_notify_ended_4dc7a",
                    table="k2b_run",
                    when="AFTER",
                ),
            ),
        ),
    ]
