"""The runtime role (#9): the kernel runs with it, and no bypass of the evidence is left to it.

A real role is created in the test cluster (unique name, dropped afterwards),
given exactly what ``manage.py grantworkflows`` grants, and used through a
second database alias by the kernel itself: starts, steps, charges, parks,
wakes, resolutions and cancels. Then each bypass of the issue is tried as
that role and must fail with ``insufficient_privilege`` (42501).
"""

from __future__ import annotations

import datetime as dt
import io

import pgtrigger
import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, connections, transaction
from django.test import override_settings

from k2b_workflows import cancel_workflow_run, start_workflow_run, wake_workflow_runs_waiting_on
from k2b_workflows.checks import check_runtime_role
from k2b_workflows.kernel import db, pauses, waits
from k2b_workflows.models import JournalEntry, LedgerEntry, WorkflowRun
from k2b_workflows.retention import purge_finished_runs
from k2b_workflows.roles import (
    APPEND_ONLY_TABLES,
    excess_privileges,
)
from k2b_workflows.testing import run_until_idle
from tests.models import DomainRow, ProviderCall
from tests.support import runtime_role
from tests.support.runtime_role import RUNTIME, as_runtime, refused

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", RUNTIME])

#: The fixture, under the name the tests ask for.
runtime = runtime_role.runtime
_as_runtime = as_runtime
_refused = refused


def _trigger_ids() -> str:
    """Every k2b_workflows trigger, as ``pgtrigger.ignore`` would name them in the setting."""
    ids = [
        trigger.get_pgid(model)
        for model, trigger in pgtrigger.registered()
        if model._meta.app_label == "k2b_workflows"
    ]
    assert len(ids) >= 6
    return "{" + ",".join(ids) + "}"


def test_the_kernel_runs_as_the_runtime_role(runtime):
    with connections[RUNTIME].cursor() as cursor:
        cursor.execute("SELECT current_user")
        assert cursor.fetchone()[0] == runtime
    charged = start_workflow_run("test.charge", {"amount": 3})
    parked = start_workflow_run("integrity.charge_then_wait", {"amount": 4, "key": "rt"})
    fanned = start_workflow_run("fanout.parent", {"items": [{"n": 1}, {"n": 2}]})
    doomed = start_workflow_run("kernel.tamper", {"key": "never"})
    run_until_idle(using=RUNTIME)
    DomainRow.objects.using(RUNTIME).create(key="rt")
    wake_workflow_runs_waiting_on(app_id="tests", kind="signal", key="rt")
    cancel_workflow_run(doomed.pk, "not needed")
    run_until_idle(using=RUNTIME)
    # The housekeeping's wake purge runs once a minute per process: run it here, as
    # the runtime role, whatever ran before this test.
    waits.purge_stale_rendezvous(RUNTIME, force=True)
    statuses = dict(
        WorkflowRun.objects.using(RUNTIME)
        .filter(pk__in=[charged.pk, parked.pk, doomed.pk, fanned.pk])
        .values_list("pk", "status")
    )
    assert statuses == {
        charged.pk: "succeeded",
        parked.pk: "succeeded",
        doomed.pk: "canceled",
        fanned.pk: "succeeded",
    }
    assert ProviderCall.objects.filter(action="test.charge").count() == 2
    assert excess_privileges(RUNTIME) == []


def test_the_runtime_role_pauses_and_resumes_a_queue_and_its_claims_read_the_pause(runtime):
    """The web process pauses queues and every worker's claim reads the pause (#49)."""
    assert pauses.pause(RUNTIME, "held", reason="outage", paused_by="olga") is not None
    held = start_workflow_run("queues.held", {"n": 1})
    run_until_idle(using=RUNTIME)
    assert WorkflowRun.objects.get(pk=held.pk).status == "queued"
    assert pauses.resume(RUNTIME, "held", resumed_by="olga") is not None
    run_until_idle(using=RUNTIME)
    assert WorkflowRun.objects.get(pk=held.pk).status == "succeeded"


def test_the_runtime_role_writes_progress_and_can_delete_none(runtime):
    """Progress is display (#49): the worker writes it as the runtime role, which may not
    delete it (retention does, as the owner); it holds no key to the run rows."""
    from k2b_workflows import progress_of
    from k2b_workflows.kernel import progress as progress_writer
    from tests.tasks_app import reporting

    try:
        result = reporting.reports_then_fails.enqueue(3, 10)
        run_until_idle(using=RUNTIME)
    finally:
        progress_writer.writer.stop()  # its connection is the runtime role's
    progress = progress_of(result)
    assert progress is not None and (progress.done, progress.total) == (3, 10)
    _refused("DELETE FROM k2b_progress")
    _refused("TRUNCATE k2b_progress")


def test_the_runtime_role_reads_the_clock_where_functions_are_not_public(runtime):
    # A hardened database revokes PUBLIC's default EXECUTE on functions:
    # every kernel statement reads k2b_now(), so the grants must name it.
    # The flow-control functions too: the slot triggers run them as the runtime role.
    from k2b_workflows.roles import KERNEL_FUNCTIONS

    functions = ", ".join(f"{name}({args})" for name, args in KERNEL_FUNCTIONS)
    with connection.cursor() as cursor:
        cursor.execute(f"REVOKE EXECUTE ON FUNCTION {functions} FROM PUBLIC")
    try:
        runs = [
            start_workflow_run("test.pure", {"a": 1, "b": 2}),
            start_workflow_run("flow.one_at_a_time", {"key": "g", "nap": 0}, concurrency_key="g"),
            start_workflow_run("flow.one_at_a_time", {"key": "g", "nap": 0}, concurrency_key="g"),
            start_workflow_run("flow.rated_per_key", {"api_key": "g"}),
        ]
        run_until_idle(using=RUNTIME)
        statuses = {WorkflowRun.objects.get(pk=run.pk).status for run in runs}
        assert statuses == {"succeeded"}
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"GRANT EXECUTE ON FUNCTION {functions} TO PUBLIC")


@pytest.fixture
def evidence_written(runtime) -> WorkflowRun:
    run = start_workflow_run("test.charge", {"amount": 3})
    run_until_idle(using=RUNTIME)
    assert JournalEntry.objects.filter(run=run).exists()
    return run


@pytest.mark.parametrize("table", APPEND_ONLY_TABLES)
def test_the_runtime_role_cannot_truncate(evidence_written, table):
    _refused(f"TRUNCATE {table}")


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE k2b_journal SET output = '{\"amount\": 999}'",
        "DELETE FROM k2b_journal",
        "UPDATE k2b_ledger SET actor = 'mallory'",
        "DELETE FROM k2b_ledger",
        "UPDATE k2b_budget_charge SET amount = 0",
        "DELETE FROM k2b_budget_charge",
    ],
)
def test_the_trigger_ignore_setting_gives_the_runtime_role_nothing(evidence_written, sql):
    with (
        pytest.raises(DatabaseError) as caught,
        transaction.atomic(using=RUNTIME),
        connections[RUNTIME].cursor() as cursor,
    ):
        cursor.execute("SELECT set_config('pgtrigger.ignore', %s, true)", [_trigger_ids()])
        cursor.execute(sql)
    assert db.sqlstate(caught.value) == "42501", caught.value
    assert LedgerEntry.objects.filter(run=evidence_written, actor="mallory").count() == 0


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE k2b_run SET generation = 0 WHERE id = %s",
        "UPDATE k2b_run SET status = 'queued' WHERE id = %s",
    ],
)
def test_the_runtime_role_cannot_ignore_the_run_lifecycle_triggers(evidence_written, sql):
    """It may update runs, so privileges alone do not protect their rules: the triggers
    honour ``pgtrigger.ignore`` for the owner only."""
    with (
        pytest.raises(DatabaseError) as caught,
        transaction.atomic(using=RUNTIME),
        connections[RUNTIME].cursor() as cursor,
    ):
        cursor.execute("SELECT set_config('pgtrigger.ignore', %s, true)", [_trigger_ids()])
        cursor.execute(sql, [evidence_written.pk])
    assert db.sqlstate(caught.value) == "42501", caught.value
    assert "only the owner" in str(caught.value)
    run = WorkflowRun.objects.get(pk=evidence_written.pk)
    assert (run.status, run.generation > 0) == ("succeeded", True)


@pytest.mark.parametrize("table", APPEND_ONLY_TABLES)
def test_the_runtime_role_cannot_disable_triggers(evidence_written, table):
    _refused(f"ALTER TABLE {table} DISABLE TRIGGER ALL")


def test_the_runtime_role_cannot_replace_the_ignore_function(evidence_written):
    _refused(
        """CREATE OR REPLACE FUNCTION public._pgtrigger_should_ignore(trigger_name NAME)
           RETURNS BOOLEAN AS $$ BEGIN RETURN TRUE; END; $$ LANGUAGE plpgsql"""
    )


def test_purge_needs_the_owner(evidence_written):
    WorkflowRun.objects.filter(pk=evidence_written.pk).update(
        finished_at=WorkflowRun.objects.get(pk=evidence_written.pk).finished_at
        - dt.timedelta(days=30)
    )
    with pytest.raises(DatabaseError):
        purge_finished_runs(older_than=dt.timedelta(days=1), using=RUNTIME)
    assert JournalEntry.objects.filter(run=evidence_written).exists()
    with override_settings(
        K2B_WORKFLOWS={**settings.K2B_WORKFLOWS, "DATABASE": RUNTIME, "OWNER_DATABASE": "default"}
    ):
        counts = purge_finished_runs(older_than=dt.timedelta(days=1))
    assert counts["run trees"] == 1
    assert not WorkflowRun.objects.filter(pk=evidence_written.pk).exists()


def test_the_check_warns_for_the_owner_and_not_for_the_runtime_role(runtime):
    assert check_runtime_role(databases=[RUNTIME]) == []
    with override_settings(K2B_WORKFLOWS={**settings.K2B_WORKFLOWS, "DATABASE": "default"}):
        (warning,) = check_runtime_role(databases=["default"])
    assert warning.id == "k2b_workflows.W003" and "superuser" in warning.msg


def test_grantworkflows_prints_only_insert_and_select_on_the_evidence():
    out = io.StringIO()
    call_command("grantworkflows", "k2b_app", stdout=out)
    lines = out.getvalue().splitlines()
    assert (
        'GRANT SELECT, INSERT ON TABLE "k2b_journal", "k2b_ledger", "k2b_budget_charge", '
        '"k2b_task_attempt" TO "k2b_app";'
    ) in lines
    assert lines[1].startswith("REVOKE ALL ON TABLE ") and '"k2b_journal"' in lines[1]
    mutable = next(line for line in lines if "UPDATE" in line)
    assert '"k2b_wait"' in mutable and '"k2b_journal"' not in mutable
    # The run's and the budget's rows: UPDATE of every column but those that
    # decide how often an effect may happen (#35).
    run = next(line for line in lines if 'ON TABLE "k2b_run"' in line)
    assert run.startswith('GRANT SELECT, INSERT, UPDATE ("id", "workflow_version", ')
    for column in ("holds_slot", "concurrency_key", "concurrency_limit", "workflow_name"):
        assert f'"{column}"' not in run
    account = next(line for line in lines if 'ON TABLE "k2b_budget_account"' in line)
    assert account == (
        'GRANT SELECT, INSERT, UPDATE ("spent", "ai_calls", "children") '
        'ON TABLE "k2b_budget_account" TO "k2b_app";'
    )
    assert 'GRANT SELECT ON TABLE "k2b_rate_dispatch" TO "k2b_app";' in lines
    assert not any("TRUNCATE" in line for line in lines)
    deletes = [line for line in lines if "DELETE" in line]
    assert deletes == [
        'GRANT DELETE ON TABLE "k2b_overview_minute", "k2b_queue_pause", "k2b_schedule", '
        '"k2b_schedule_skip", "k2b_wait", "k2b_worker" TO "k2b_app";'
    ]
    functions = next(line for line in lines if "EXECUTE" in line)
    assert functions.startswith('GRANT EXECUTE ON FUNCTION "public"."k2b_now"(), ')
    assert '"public"."k2b_flow_admit"(text, text)' in functions


def test_grantworkflows_quotes_a_hostile_role_name_as_one_identifier():
    """The role name is an identifier, never SQL: the review's injection names a role
    that does not exist, and nothing of it runs."""
    hostile = 'x"; CREATE TABLE k2b_pwned (); --'
    with pytest.raises(CommandError, match="could not apply grants"):
        call_command("grantworkflows", hostile, "--apply", stdout=io.StringIO())
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass('k2b_pwned')")
        assert cursor.fetchone() == (None,)
    out = io.StringIO()
    call_command("grantworkflows", hostile, stdout=out)
    assert 'TO "x""; CREATE TABLE k2b_pwned (); --";' in out.getvalue()
