"""How often a step may run again, and a tree's budget limits, are sealed too (#47).

The runtime role could set ``consecutive_failures`` back to 0 while a run waited
for its retry (a step bounded to 3 attempts ran 213 times) and move a failed run
back to ``queued``. A reset of the count, and a run queued again after it failed
or needed an operator, now carry a new ``attempts_seq`` sealed by the kernel
(``kernel/attempts.py``); these triggers refuse the rest.

The table's owner raised a queued run's ``effect_budget`` from 1 to 100 unseen:
each budget account now carries a seal over its limits (``limits_seal``), and
the accounts written before this migration are sealed with their limits as
they are now.
"""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

import k2b_workflows.triggers


def seal_existing_limits(apps, schema_editor):
    from k2b_workflows.kernel.seals import limits_seal

    BudgetAccount = apps.get_model("k2b_workflows", "BudgetAccount")
    db = schema_editor.connection.alias
    batch = []
    with schema_editor.connection.cursor() as cursor:
        for account in BudgetAccount.objects.using(db).order_by("pk").iterator(chunk_size=2000):
            sealed = limits_seal(
                account.root_id, account.effect_budget, account.max_ai_calls, account.max_steps
            )
            batch.append((sealed, account.root_id))
            if len(batch) >= 2000:
                cursor.executemany(_SEAL_SQL, batch)
                batch = []
        if batch:
            cursor.executemany(_SEAL_SQL, batch)


_SEAL_SQL = "UPDATE k2b_budget_account SET limits_seal = %s WHERE root_id = %s"


class Migration(migrations.Migration):
    dependencies = [
        ("k2b_workflows", "0026_transition_checks_in_when"),
    ]

    operations = [
        migrations.AddField(
            model_name="budgetaccount",
            name="limits_seal",
            field=models.CharField(blank=True, db_default="", default="", max_length=100),
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="attempts_seal",
            field=models.CharField(
                blank=True, db_default="", default="", editable=False, max_length=100
            ),
        ),
        migrations.AddField(
            model_name="workflowrun",
            name="attempts_seq",
            field=models.BigIntegerField(db_default=0, default=0, editable=False),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="attempts_seq_never_decreases",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition='WHEN (NEW."attempts_seq" < (OLD."attempts_seq"))',
                    declare='DECLARE _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func="RAISE EXCEPTION 'k2b_workflows: the attempts_seq of a run never decreases' USING ERRCODE = 'insufficient_privilege';",
                    hash="d983cb164f0d2e9e9c169e5d9857fecf22461267",
                    operation="UPDATE",
                    pgid="pgtrigger_attempts_seq_never_decreases_7163d",
                    table="k2b_run",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="failures_reset_by_the_kernel",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition='WHEN (NEW."consecutive_failures" < (OLD."consecutive_failures") AND NEW."attempts_seq" = (OLD."attempts_seq") AND NOT (NEW."status" = \'succeeded\'))',
                    declare='DECLARE _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func="RAISE EXCEPTION 'k2b_workflows: the failure count of a run is lowered only by the kernel, under a new sealed attempts_seq' USING ERRCODE = 'insufficient_privilege';",
                    hash="5c5220db02bd9028047e69c6ddeb2020966bb038",
                    operation="UPDATE",
                    pgid="pgtrigger_failures_reset_by_the_kernel_f1ccd",
                    table="k2b_run",
                    when="BEFORE",
                ),
            ),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="workflowrun",
            trigger=pgtrigger.compiler.Trigger(
                name="requeue_after_end_by_the_kernel",
                sql=k2b_workflows.triggers.PinnedUpsertTriggerSql(
                    condition='WHEN (OLD."status" IN (\'failed\', \'needs_attention\') AND NEW."status" = \'queued\' AND NEW."attempts_seq" <= (OLD."attempts_seq"))',
                    declare='DECLARE _k2b_owner BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID);',
                    func="RAISE EXCEPTION 'k2b_workflows: a failed run, or one waiting for an operator, is queued again only with a new sealed attempts_seq' USING ERRCODE = 'insufficient_privilege';",
                    hash="ca656fd42dfdafdac4d3e2216f8e539c42655bd1",
                    operation="UPDATE",
                    pgid="pgtrigger_requeue_after_end_by_the_kernel_5123e",
                    table="k2b_run",
                    when="BEFORE",
                ),
            ),
        ),
        migrations.RunPython(seal_existing_limits, migrations.RunPython.noop),
    ]
