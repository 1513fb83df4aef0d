"""The run row's own fields are sealed under the evidence key (#30).

Each attack is the review's, run as the runtime role (``tests/support/runtime_role.py``),
which may UPDATE ``k2b_run`` as web and workers must: a changed start field is
caught at the claim before any step sees it, and a changed end by
``verifyworkflows``, the admin and a parent reading its child's result.
"""

from __future__ import annotations

import io

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client

from k2b_workflows import EFFECT_CONFIRMED, resolve_effect, start_workflow_run, workflow
from k2b_workflows.kernel import audit, seals
from k2b_workflows.models import WorkflowRun
from k2b_workflows.store import EFFECT_OUTCOME_UNKNOWN, INTEGRITY_CHAIN_BROKEN
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall
from tests.support import runtime_role
from tests.support.runtime_role import AUDITOR, RUNTIME, as_runtime

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", RUNTIME])

runtime = runtime_role.runtime


def _verify() -> tuple[bool, str]:
    out = io.StringIO()
    try:
        call_command("verifyworkflows", stdout=out)
    except CommandError as exc:
        return False, out.getvalue() + str(exc)
    return True, out.getvalue()


def _charges() -> list[int]:
    return [c.payload["amount"] for c in ProviderCall.objects.filter(action="test.charge")]


@pytest.mark.parametrize(
    "column, value",
    [
        ("input", """'{"amount": 999}'"""),
        ("principal", """'{"user": "mallory"}'"""),
        ("idempotency_key", "'stolen-key'"),
        ("workflow_version", "2"),
        ("root_id", "NULL"),
    ],
)
def test_a_queued_run_whose_start_fields_changed_is_stopped_before_any_step(runtime, column, value):
    run = start_workflow_run("test.charge", {"amount": 99}, principal={"user": "alice"})
    as_runtime(f"UPDATE k2b_run SET {column} = {value} WHERE id = %s", [run.pk])
    run_until_idle(using=RUNTIME)
    run.refresh_from_db()
    if column == "workflow_version":
        # No worker has code for version 2: nobody claims it, verifyworkflows finds it.
        assert run.status == "queued"
    else:
        assert (run.status, run.error_code) == ("needs_attention", INTEGRITY_CHAIN_BROKEN)
        assert "start fields" in run.error_message
    assert _charges() == []
    ok, out = _verify()
    assert not ok and str(run.pk) in out and "start fields" in out


def test_an_untouched_run_charges_what_it_was_started_with(runtime):
    run = start_workflow_run("test.charge", {"amount": 99})
    run_until_idle(using=RUNTIME)
    run.refresh_from_db()
    assert run.status == "succeeded" and _charges() == [99]
    assert seals.problem(run) is None
    assert _verify()[0]


def test_a_replaced_output_of_a_succeeded_run_is_reported(runtime):
    run = start_workflow_run("test.charge", {"amount": 5})
    run_until_idle(using=RUNTIME)
    as_runtime(
        """UPDATE k2b_run SET output = '{"charge_id": "ch_forged"}' WHERE id = %s""", [run.pk]
    )
    ok, out = _verify()
    assert not ok and f"BROKEN {run.pk}" in out and "does not match its seal" in out
    problem = audit.stored_problem(run.pk, "default")
    assert problem is not None and problem.kind == "seal"


def test_an_incident_set_straight_to_succeeded_is_reported(runtime):
    run = start_workflow_run(
        "test.charge", {"amount": 5, "behaviour": "ambiguous", "reconcile": "unknown"}
    )
    run_until_idle(using=RUNTIME)
    run.refresh_from_db()
    assert (run.status, run.error_code) == ("needs_attention", EFFECT_OUTCOME_UNKNOWN)
    assert _verify()[0]  # an incident the kernel handed over is sealed as such
    as_runtime(
        "UPDATE k2b_run SET status = 'succeeded', error_code = '', output = '{}' WHERE id = %s",
        [run.pk],
    )
    ok, out = _verify()
    assert not ok and f"BROKEN {run.pk}" in out and "not ended by the kernel" in out


def test_a_seal_copied_from_an_earlier_life_of_the_run_does_not_verify(runtime):
    """The generation is under the end seal: a failure sealed in one generation cannot
    be replayed onto the row after an operator retried it."""
    run = start_workflow_run(
        "test.charge", {"amount": 5, "behaviour": "ambiguous", "reconcile": "unknown"}
    )
    run_until_idle(using=RUNTIME)
    run.refresh_from_db()
    sealed = run.end_seal
    as_runtime("UPDATE k2b_run SET generation = generation + 1 WHERE id = %s", [run.pk])
    run.refresh_from_db()
    assert run.end_seal == sealed
    assert "does not match its seal" in (seals.end_problem(run) or "")


def test_an_operators_resolution_is_sealed_when_the_run_ends(runtime):
    run = start_workflow_run(
        "test.charge", {"amount": 5, "behaviour": "ambiguous", "reconcile": "unknown"}
    )
    run_until_idle(using=RUNTIME)
    operator = User.objects.create_superuser("op", "op@example.com", "pw")
    resolve_effect(
        run.pk, EFFECT_CONFIRMED, evidence="seen in the dashboard", actor=operator, output={}
    )
    run.refresh_from_db()
    assert (run.status, run.end_seal) == ("queued", "")
    run_until_idle(using=RUNTIME)
    run.refresh_from_db()
    assert run.status == "succeeded" and seals.problem(run) is None
    assert _verify()[0]


@workflow("seals.child", app_id="seals_children")
def _child(run, input):
    return {"n": input["n"]}


@workflow("seals.parent", app_id="seals_parents")
def _parent(run, input):
    return [r.output for r in run.children("seals.child", input["items"])]


def test_a_parent_does_not_use_a_childs_forged_result(runtime):
    parent = start_workflow_run("seals.parent", {"items": [{"n": 1}, {"n": 2}]})
    run_until_idle(using=RUNTIME, app_ids=["seals_parents"])
    children = list(WorkflowRun.objects.filter(parent_id=parent.pk).order_by("child_index"))
    assert len(children) == 2
    # Ends a child without the kernel: the status rules allow queued -> running -> succeeded.
    as_runtime("UPDATE k2b_run SET status = 'running' WHERE id = %s", [children[0].pk])
    as_runtime(
        """UPDATE k2b_run SET status = 'succeeded', output = '{"n": 1000}' WHERE id = %s""",
        [children[0].pk],
    )
    run_until_idle(using=RUNTIME)  # the other child ends and wakes the parent
    parent.refresh_from_db()
    assert (parent.status, parent.error_code) == ("needs_attention", INTEGRITY_CHAIN_BROKEN)
    assert str(children[0].pk) in parent.error_message


def test_a_float_output_keeps_its_seal():
    run = start_workflow_run("test.pure", {"a": 2.5e16, "b": -0.0})
    run_until_idle()
    run.refresh_from_db()
    assert run.status == "succeeded" and seals.problem(run) is None


def test_the_admin_shows_a_tampered_run_as_tampered(runtime):
    run = start_workflow_run("test.charge", {"amount": 5})
    run_until_idle(using=RUNTIME)
    User.objects.create_superuser("admin", "a@example.com", "pw")
    client = Client()
    client.login(username="admin", password="pw")
    url = f"/admin/k2b_workflows/workflowrun/{run.pk}/change/"
    assert "k2b-integrity-verified" in client.get(url).content.decode()
    as_runtime("""UPDATE k2b_run SET output = '{"charge_id": "x"}' WHERE id = %s""", [run.pk])
    page = client.get(url).content.decode()
    assert "k2b-integrity-verified" not in page
    assert ">tampered<" in page and "does not match its seal" in page


auditor = runtime_role.auditor


@pytest.mark.django_db(transaction=True, databases=["default", AUDITOR])
def test_verifyworkflows_runs_as_a_read_only_auditor(auditor):
    good = start_workflow_run("test.charge", {"amount": 5})
    bad = start_workflow_run("test.pure", {"a": 1, "b": 2})
    run_until_idle()
    WorkflowRun.objects.filter(pk=bad.pk).update(output={"sum": 4})
    out = io.StringIO()
    with pytest.raises(CommandError, match="1 broken"):
        call_command("verifyworkflows", "--database", auditor, stdout=out)
    assert f"BROKEN {bad.pk}" in out.getvalue() and str(good.pk) not in out.getvalue()


def test_the_migration_seals_runs_started_before_seals_as_they_are():
    import importlib

    from django.apps import apps
    from django.db import connection

    migration = importlib.import_module(
        "k2b_workflows.migrations.0014_pinned_functions_and_run_seals"
    )
    done = start_workflow_run("test.charge", {"amount": 5})
    run_until_idle()
    queued = start_workflow_run("test.pure", {"a": 1, "b": 2}, principal={"user": 1})
    WorkflowRun.objects.update(start_seal="", end_seal="")
    assert all(seals.problem(run) for run in WorkflowRun.objects.all())
    with connection.schema_editor() as editor:
        migration.seal_existing_runs(apps, editor)
    for run in WorkflowRun.objects.all():
        assert seals.problem(run) is None, run
    assert WorkflowRun.objects.get(pk=done.pk).end_seal != ""
    assert WorkflowRun.objects.get(pk=queued.pk).end_seal == ""
