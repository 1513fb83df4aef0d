"""``manage.py workflowrun``: every verb does what its Python function does, with its errors.

Exit codes are the promise a script relies on: each refusal is checked by
its code, and that nothing changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from io import StringIO

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from k2b_workflows import start_workflow_run
from k2b_workflows.management.commands.workflowrun import (
    BAD_INPUT,
    NOT_FOUND,
    PERMISSION_DENIED,
    REFUSED,
)
from k2b_workflows.models import LedgerEntry, WorkflowRun
from k2b_workflows.store import EFFECT_OUTCOME_UNKNOWN, WORKFLOW_RETRY_EXHAUSTED
from tests.support.admin import user_with
from tests.support.kernel import describe, exhausted_run, fresh, ledger_kinds, run_to_end
from tests.support.processes import ROOT

pytestmark = pytest.mark.django_db(transaction=True)


def workflowrun(*args: str) -> dict:
    """Run the command with ``--json`` and return its parsed output."""
    out = StringIO()
    call_command("workflowrun", *args, "--json", stdout=out, stderr=StringIO())
    return json.loads(out.getvalue())


def refused(*args: str) -> tuple[int, dict]:
    """The exit code of a failing verb and the JSON error it printed."""
    out = StringIO()
    with pytest.raises(CommandError) as info:
        call_command("workflowrun", *args, "--json", stdout=out, stderr=StringIO())
    assert "\n" not in str(info.value)
    return info.value.returncode, json.loads(out.getvalue())


@pytest.fixture
def doubted_run() -> WorkflowRun:
    run = start_workflow_run("kernel.blind_once", {})
    run_to_end()
    assert describe(run)["code"] == EFFECT_OUTCOME_UNKNOWN
    return run


def test_start_queues_a_run_and_the_same_key_returns_it():
    first = workflowrun(
        "start", "test.pure", "--input", '{"a": 1, "b": 2}', "--idempotency-key", "k"
    )
    again = workflowrun(
        "start", "test.pure", "--input", '{"a": 1, "b": 2}', "--idempotency-key", "k"
    )
    assert first["ok"] and first["run"]["status"] == "queued"
    assert again["run"]["id"] == first["run"]["id"]
    assert WorkflowRun.objects.get().input == {"a": 1, "b": 2}


@pytest.mark.parametrize(
    ("args", "code", "match"),
    [
        (["start", "no.such", "--input", "{}"], NOT_FOUND, "no.such"),
        (["start", "test.pure", "--input", "{nope"], BAD_INPUT, "--input is not valid JSON"),
        (["start", "test.pure", "--input", "null"], BAD_INPUT, "must not be None"),
        (["start", "test.pure", "--input", '{"a": "\\u0000"}'], BAD_INPUT, "NUL"),
        (["start", "test.pure", "--principal", "[", "--input", "{}"], BAD_INPUT, "--principal"),
        (["start", "test.pure", "--input", "@/no/such/file"], BAD_INPUT, "cannot read"),
    ],
)
def test_start_refuses_what_start_workflow_run_refuses_and_creates_nothing(args, code, match):
    returncode, error = refused(*args)
    assert returncode == code
    assert match in error["message"]
    assert not WorkflowRun.objects.exists()


def test_start_with_a_key_already_used_for_another_input_is_refused():
    workflowrun("start", "test.pure", "--input", '{"a": 1, "b": 2}', "--idempotency-key", "k")
    returncode, error = refused(
        "start", "test.pure", "--input", '{"a": 9, "b": 2}', "--idempotency-key", "k"
    )
    assert (returncode, error["error"]) == (REFUSED, "refused")
    assert WorkflowRun.objects.count() == 1


def test_start_takes_a_concurrency_key_a_priority_and_a_run_after():
    """The arguments of start_workflow_run a shell could not give (#38)."""
    run = workflowrun(
        "start",
        "flow.keyed",
        "--concurrency-key",
        "customer-7",
        "--priority",
        "9",
        "--run-after",
        "2099-01-02T03:04:05+01:00",
    )["run"]
    stored = WorkflowRun.objects.get(pk=run["id"])
    assert (stored.concurrency_key, stored.priority) == ("customer-7", 9)
    assert stored.run_after.isoformat() == "2099-01-02T02:04:05+00:00"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["flow.keyed", "--priority", "1001"], "priority"),
        (["flow.keyed", "--run-after", "2099-01-02T03:04:05"], "run_after must be timezone-aware"),
        (["test.pure", "--concurrency-key", "k"], "declares no concurrency"),
    ],
)
def test_start_refuses_a_bad_priority_run_after_or_key_as_the_api_does(args, match):
    returncode, error = refused("start", *args)
    assert returncode == BAD_INPUT
    assert match in error["message"], error
    assert not WorkflowRun.objects.exists()


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--priority", "high"], "--priority: must be a whole number"),
        (["--run-after", "tomorrow"], "--run-after: must be an ISO 8601 date and time"),
        (["--concurrency-key", ""], "--concurrency-key: must be 1 to 255 characters"),
    ],
)
def test_start_names_the_option_it_cannot_parse(args, match):
    with pytest.raises(CommandError, match=match):
        call_command("workflowrun", "start", "flow.keyed", *args, stdout=StringIO())
    assert not WorkflowRun.objects.exists()


def test_start_reads_its_input_from_a_file(tmp_path):
    path = tmp_path / "input.json"
    path.write_text('{"a": 3, "b": 4}')
    run = workflowrun("start", "test.pure", "--input", f"@{path}")["run"]
    assert WorkflowRun.objects.get(pk=run["id"]).input == {"a": 3, "b": 4}


def test_show_prints_the_state_and_steps_and_never_the_input():
    run = start_workflow_run("test.pure", {"a": 1, "b": 2, "password": "hunter2"})
    run_to_end()
    shown = workflowrun("show", str(run.pk))["run"]
    assert shown["status"] == "succeeded"
    assert [s["state"] for s in shown["steps"]] == ["succeeded"] * len(shown["steps"])
    assert shown["steps"] and "hunter2" not in json.dumps(shown)
    text = StringIO()
    call_command("workflowrun", "show", str(run.pk), stdout=text)
    assert "succeeded" in text.getvalue() and "step   0" in text.getvalue()


@pytest.mark.parametrize(
    ("run_id", "code"),
    [("not-a-uuid", BAD_INPUT), ("6f1c2d8e-2b8a-4c39-9a53-0c8f4e1d2a77", NOT_FOUND)],
)
def test_show_of_a_malformed_or_unknown_id_says_which(run_id, code):
    assert refused("show", run_id)[0] == code


def test_cancel_ends_a_run_with_its_ledger_entry_and_logs_the_actor():
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    op = user_with("cancel_workflowrun", "view_workflowrun")
    out = workflowrun("cancel", str(run.pk), "--reason", "customer asked", "--actor", "op")
    assert (out["run"]["status"], out["changed"]) == ("canceled", True)
    assert ledger_kinds(run) == ["canceled"]
    assert LedgerEntry.objects.get(run=run).message == "customer asked (by op)"
    log = LogEntry.objects.get(user=op)
    assert (log.object_id, log.action_flag, log.change_message) == (
        str(run.pk),
        CHANGE,
        "Cancel: customer asked",
    )
    again = workflowrun("cancel", str(run.pk), "--reason", "again")
    assert again["changed"] is False and LogEntry.objects.count() == 1


def test_cancel_needs_a_reason_and_the_actor_its_permission():
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    user_with("view_workflowrun", name="viewer")
    assert refused("cancel", str(run.pk), "--reason", " ")[0] == BAD_INPUT
    assert refused("cancel", str(run.pk), "--reason", "x", "--actor", "viewer")[0] == (
        PERMISSION_DENIED
    )
    assert fresh(run).status == "queued"


def test_retry_requeues_an_exhausted_run_as_the_admin_does():
    run = exhausted_run()
    op = user_with("retry_workflowrun", "view_workflowrun")
    out = workflowrun("retry", str(run.pk), "--actor", "op", "--reason", "provider is back")
    assert out["run"]["status"] == "queued"
    retried = LedgerEntry.objects.get(run=run, kind="retried")
    assert (retried.actor, retried.actor_id) == ("op", op.pk)
    assert LogEntry.objects.get(user=op).change_message == "Retry now: provider is back"


@pytest.mark.parametrize(
    ("perms", "actor", "code", "match"),
    [
        (("retry_workflowrun",), "op", PERMISSION_DENIED, "view_workflowrun"),
        (("view_workflowrun",), "op", PERMISSION_DENIED, "retry_workflowrun"),
        (("retry_workflowrun", "view_workflowrun"), "nobody", NOT_FOUND, "no user 'nobody'"),
    ],
)
def test_retry_needs_a_known_actor_with_the_admins_permissions(perms, actor, code, match):
    run = exhausted_run()
    user_with(*perms)
    returncode, error = refused("retry", str(run.pk), "--actor", actor, "--reason", "r")
    assert (returncode, match in error["message"]) == (code, True)
    assert (fresh(run).status, fresh(run).error_code) == ("failed", WORKFLOW_RETRY_EXHAUSTED)
    assert not LogEntry.objects.exists()


def test_retry_of_an_inactive_actor_is_denied():
    run = exhausted_run()
    op = user_with("retry_workflowrun", "view_workflowrun")
    User.objects.filter(pk=op.pk).update(is_active=False)
    assert refused("retry", str(run.pk), "--actor", "op", "--reason", "r")[0] == PERMISSION_DENIED
    assert fresh(run).status == "failed"


def test_retry_of_a_run_that_is_not_failed_is_refused():
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    user_with("retry_workflowrun", "view_workflowrun")
    assert refused("retry", str(run.pk), "--actor", "op", "--reason", "r")[0] == REFUSED
    assert fresh(run).status == "queued" and not LogEntry.objects.exists()


def test_retry_requires_an_actor():
    run = exhausted_run()
    with pytest.raises(CommandError, match="--actor"):
        call_command("workflowrun", "retry", str(run.pk), "--reason", "r", stdout=StringIO())


def test_wake_requeues_the_runs_waiting_on_a_key():
    run = start_workflow_run("test.wait", {"key": "order-7"})
    run_to_end()
    assert fresh(run).status == "waiting"
    dependency = fresh(run)
    out = workflowrun(
        "wake",
        "--app",
        dependency.app_id,
        "--kind",
        dependency.wait_kind,
        "--key",
        dependency.wait_key,
    )
    assert out["woken"] == 1 and fresh(run).status == "queued"
    assert refused("wake", "--app", "tests", "--kind", "k", "--key", "x" * 501)[0] == BAD_INPUT


def test_resolve_absent_requeues_with_the_evidence_entry_and_the_admins_log(doubted_run):
    op = user_with("resolve_effect")
    step = fresh(doubted_run).attention_step
    out = workflowrun(
        "resolve",
        str(doubted_run.pk),
        "--decision",
        "absent",
        "--evidence",
        "provider dashboard shows no charge",
        "--actor",
        "op",
        "--step",
        str(step),
    )
    assert out["run"]["status"] == "queued"
    entry = LedgerEntry.objects.get(run=doubted_run, kind="resolved_absent")
    assert (entry.actor, entry.evidence) == ("op", "provider dashboard shows no charge")
    assert LogEntry.objects.get(user=op).change_message == (
        f"Resolved step {step} (effect absent): provider dashboard shows no charge"
    )


def test_resolve_confirmed_journals_the_output_read_from_stdin(doubted_run, monkeypatch):
    user_with("resolve_effect")
    monkeypatch.setattr(sys, "stdin", StringIO('{"charge_id": "ch_1"}'))
    out = workflowrun(
        "resolve",
        str(doubted_run.pk),
        "--decision",
        "confirmed",
        "--evidence",
        "seen in the dashboard",
        "--actor",
        "op",
        "--output",
        "-",
    )
    assert out["run"]["status"] == "queued"
    assert "resolved_confirmed" in ledger_kinds(doubted_run)


@pytest.mark.parametrize(
    ("extra", "perms", "code"),
    [
        (["--decision", "absent", "--evidence", " "], ("resolve_effect",), BAD_INPUT),
        (["--decision", "absent", "--evidence", "e"], ("retry_workflowrun",), PERMISSION_DENIED),
        (["--decision", "absent", "--evidence", "e", "--step", "7"], ("resolve_effect",), REFUSED),
        (
            ["--decision", "absent", "--evidence", "e", "--seen-ledger-id", "1"],
            ("resolve_effect",),
            REFUSED,
        ),
        (
            ["--decision", "confirmed", "--evidence", "e", "--output", "{bad"],
            ("resolve_effect",),
            BAD_INPUT,
        ),
        (
            ["--decision", "absent", "--evidence", "e", "--output", "{}"],
            ("resolve_effect",),
            BAD_INPUT,
        ),
        # As the admin's form: "confirmed" journals --output as the step's result,
        # and without one the workflow went on with None and crashed on it (#38).
        (["--decision", "confirmed", "--evidence", "e"], ("resolve_effect",), BAD_INPUT),
    ],
)
def test_resolve_refusals_change_nothing(doubted_run, extra, perms, code):
    user_with(*perms)
    kinds = ledger_kinds(doubted_run)
    returncode, _ = refused("resolve", str(doubted_run.pk), "--actor", "op", *extra)
    assert returncode == code
    assert ledger_kinds(doubted_run) == kinds
    assert fresh(doubted_run).status == "needs_attention" and not LogEntry.objects.exists()


def test_resolve_of_a_run_that_needs_no_decision_is_refused():
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    user_with("resolve_effect")
    returncode, error = refused(
        "resolve", str(run.pk), "--decision", "absent", "--evidence", "e", "--actor", "op"
    )
    assert (returncode, error["error"]) == (REFUSED, "refused")


def test_exit_codes_reach_the_shell():
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "K2B_TEST_DB_NAME": connection.settings_dict["NAME"],
    }
    missing = subprocess.run(
        [sys.executable, "manage.py", "workflowrun", "show", str(uuid.uuid4()), "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == NOT_FOUND, missing.stderr
    assert json.loads(missing.stdout)["error"] == "not_found"
    assert "Traceback" not in missing.stderr
    usage = subprocess.run(
        [sys.executable, "manage.py", "workflowrun", "explode"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert usage.returncode == 2 and "invalid choice" in usage.stderr


# -- fork ----------------------------------------------------------------------------------


@pytest.fixture
def failed_line():
    from tests.workflows import forks

    forks.BROKEN["on"] = True
    run = start_workflow_run("forks.line", {"to": "a@example.com", "pay": True})
    run_to_end()
    assert fresh(run).status == "failed"
    yield run
    forks.BROKEN["on"] = True


def test_fork_goes_on_from_a_step_and_is_logged_as_the_admin_logs_it(failed_line):
    user_with("view_workflowrun", "fork_workflowrun", name="fran")
    out = workflowrun(
        "fork", str(failed_line.pk), "--from-step", "failure", "--actor", "fran", "--reason", "fix"
    )
    assert out["ok"] and out["run"]["forked_from"] == str(failed_line.pk)
    assert out["run"]["status"] == "queued"
    entry = LogEntry.objects.get(object_id=str(failed_line.pk))
    assert entry.get_change_message() == f"Forked from step 3 as {out['run']['id']}: fix"


def test_fork_over_an_external_effect_is_refused_until_it_is_named(failed_line):
    user_with("view_workflowrun", "fork_workflowrun", name="fran")
    args = ["fork", str(failed_line.pk), "--from-step", "1", "--actor", "fran", "--reason", "r"]
    code, error = refused(*args)
    assert (code, error["error"]) == (REFUSED, "refused")
    assert "--repeat-effect 2" in error["message"]
    assert not failed_line.forks.exists()
    assert workflowrun(*args, "--repeat-effect", "2")["ok"]


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--from-step", "7", "--actor", "fran", "--reason", "r"], BAD_INPUT),
        (["--from-step", "1", "--actor", "nobody", "--reason", "r"], NOT_FOUND),
        (["--from-step", "1", "--actor", "vic", "--reason", "r"], PERMISSION_DENIED),
    ],
)
def test_fork_refusals_have_their_exit_codes_and_change_nothing(failed_line, args, code):
    user_with("view_workflowrun", "fork_workflowrun", name="fran")
    user_with("view_workflowrun", name="vic")
    assert refused("fork", str(failed_line.pk), *args)[0] == code
    assert not failed_line.forks.exists()
