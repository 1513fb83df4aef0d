"""The status rules run only when an update changes the status (#13).

The FSM trigger's function raised only for a change of ``status`` and
returned the row otherwise, yet PostgreSQL called it (a PL/pgSQL function,
with the owner-only ignore check) for every update of a run: every step's
fence, every lease renewal. ``WHEN (OLD.status IS DISTINCT FROM NEW.status)``
skips the call when there is nothing to check. Removed and re-created in one
transaction, so no update goes unchecked in between.
"""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0010_run_hot_updates"),
    ]

    operations = [
        pgtrigger.migrations.RemoveTrigger(
            model_name="workflowrun",
            name="status_transitions",
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="status_transitions",
                sql=pgtrigger.compiler.UpsertTriggerSql(
                    condition='WHEN (OLD."status" IS DISTINCT FROM (NEW."status"))',
                    declare='DECLARE _is_valid_transition BOOLEAN; _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func='SELECT CONCAT(OLD."status", \':\', NEW."status") = ANY(\'{queued:running,queued:canceled,running:queued,running:waiting,running:succeeded,running:failed,running:needs_attention,running:canceled,waiting:queued,waiting:canceled,needs_attention:queued,needs_attention:succeeded,needs_attention:canceled,failed:queued}\'::text[]) INTO _is_valid_transition; IF (_is_valid_transition IS FALSE AND OLD."status" IS DISTINCT FROM NEW."status") THEN RAISE EXCEPTION \'pgtrigger: Invalid transition of field "status" from "%" to "%" on table %\', OLD."status", NEW."status", TG_TABLE_NAME; ELSE RETURN NEW; END IF;',
                    hash="0b209b7aa9dd18d7e5fce3764888c8c44fb4660f",
                    operation="UPDATE",
                    pgid="pgtrigger_status_transitions_60e15",
                    table="k2b_run",
                    when="BEFORE",
                ),
            ),
        ),
    ]
