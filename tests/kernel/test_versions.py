"""Changing workflow code under runs in flight: pinned versions, patches, and code incidents.

In-process: the test process registers both versions of ``ver.checkout``
(see ``tests/workflows/versions.py``). The rolling deploy with two worker
processes running different code is in ``test_rolling_deploy.py``.
"""

from __future__ import annotations

import io

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.urls import reverse

from k2b_workflows import start_workflow_run, wake_workflow_runs_waiting_on
from k2b_workflows.control import retry_workflow_run
from k2b_workflows.exceptions import NotRetryable, UnknownWorkflow
from k2b_workflows.kernel import claim, evidence
from k2b_workflows.models import JournalEntry, WorkflowRun
from k2b_workflows.store import WORKFLOW_CODE_ERROR, WORKFLOW_NONDETERMINISTIC
from k2b_workflows.versions import missing_code_reason, runs_missing_code
from k2b_workflows.workflows import registered_workflows
from tests.models import DomainRow, ProviderCall
from tests.support.admin import client_for, make_user, run_url
from tests.support.kernel import describe, fresh, journal, run_to_end
from tests.workflows.versions import PATCH_ID

pytestmark = pytest.mark.django_db(transaction=True)


def stamps(run: WorkflowRun) -> list[dict]:
    return [
        c.payload
        for c in ProviderCall.objects.filter(action="ver.stamp").order_by("id")
        if c.payload["run"] == str(run.pk)
    ]


def park(name: str, input: dict, **kwargs) -> WorkflowRun:
    run = start_workflow_run(name, input, **kwargs)
    run_to_end()
    assert fresh(run).status == "waiting", describe(run)
    return run


def wake(key: str) -> None:
    DomainRow.objects.get_or_create(key=key)
    wake_workflow_runs_waiting_on(app_id="versions", kind="signal", key=key)


# Pinned versions ---------------------------------------------------------------------------


def test_a_waiting_run_woken_after_a_version_bump_finishes_on_its_own_version():
    # The bug of #10: the run finished on the new code and kept workflow_version=1.
    run = park("ver.checkout", {"key": "bump"}, version=1)
    wake("bump")
    run_to_end()
    done = fresh(run)
    assert (done.status, done.workflow_version) == ("succeeded", 1)
    assert done.output["version"] == 1 and done.output["finished_on"] == "v1"
    assert [s["code"] for s in stamps(run)] == [None, "v1"]


def test_start_uses_the_newest_registered_version_unless_told():
    assert registered_workflows()["ver.checkout"].version == 2
    assert start_workflow_run("ver.checkout", {"key": "x"}).workflow_version == 2
    assert start_workflow_run("ver.checkout", {"key": "x"}, version=1).workflow_version == 1


def test_starting_an_unregistered_version_is_refused_and_creates_nothing():
    before = WorkflowRun.objects.count()
    with pytest.raises(UnknownWorkflow, match="no version 7"):
        start_workflow_run("ver.checkout", {"key": "x"}, version=7)
    assert WorkflowRun.objects.count() == before


def test_a_claim_takes_only_runs_of_the_versions_the_worker_registered():
    old = start_workflow_run("ver.checkout", {"key": "x"}, version=1)
    new = start_workflow_run("ver.checkout", {"key": "x"}, version=2)
    claimed = claim.claim_runs(
        "default", worker_id="v2-only", workflows=[("ver.checkout", 2)], app_ids=None, limit=10
    )
    assert [run_id for run_id, _ in claimed] == [new.pk]
    assert fresh(old).status == "queued" and fresh(old).generation == 0


def test_a_run_whose_version_has_no_code_here_is_named_as_such():
    run = WorkflowRun.objects.create(
        workflow_name="ver.checkout", workflow_version=9, app_id="versions", input={}
    )
    assert missing_code_reason("ver.checkout", 9) == (
        "no registered code for version 9 in this process"
    )
    assert missing_code_reason("ver.checkout", 1) == ""
    assert list(runs_missing_code()) == [run]
    # With the live workers' pairs (a status command that knows them), it speaks of the fleet.
    assert missing_code_reason("ver.checkout", 1, live={("ver.checkout", 2)}) == (
        "no live worker has code for version 1"
    )
    # With no live worker at all, that is what it says, not that a version is missing.
    assert missing_code_reason("ver.checkout", 1, live=set()) == "no worker is running"
    # The admin and the command ask the fleet (the workers' heartbeats): none is live here.
    out = io.StringIO()
    call_command("workflowruns", stdout=out)
    assert f"run {run.pk} (ver.checkout v9): no worker is running" in out.getvalue()
    staff = make_user("vera", "view_workflowrun")
    html = client_for(staff).get(run_url(run)).content.decode()
    assert "no worker is running" in html
    assert "no live worker has code" not in html


# Patches -----------------------------------------------------------------------------------


def markers(run: WorkflowRun) -> list[int]:
    return [e.seq for e in journal(run) if e.action_name == f"k2b.patch:{PATCH_ID}"]


def test_patched_is_false_for_a_run_that_passed_the_point_and_true_for_new_ones(monkeypatch):
    monkeypatch.setenv("K2B_TEST_PATCH", "old")
    DomainRow.objects.create(key="passed-k1")
    passed = park("ver.patched", {"k1": "passed-k1", "k2": "passed-k2"})  # old-b journaled
    before = park("ver.patched", {"k1": "before-k1", "k2": "before-k2"})  # parked before it
    monkeypatch.setenv("K2B_TEST_PATCH", "new")
    DomainRow.objects.create(key="new-k1")
    new = park("ver.patched", {"k1": "new-k1", "k2": "new-k2"})
    for key in ("passed-k2", "before-k1", "before-k2", "new-k2"):
        wake(key)
    run_to_end()
    assert fresh(passed).output == {"branch": "old"}, describe(passed)
    assert fresh(before).output == {"branch": "new"}, describe(before)
    assert fresh(new).output == {"branch": "new"}, describe(new)
    assert markers(passed) == [] and markers(before) == [2] and markers(new) == [2]
    # The old run's step b ran once, under the old code; replay did not run it again.
    assert [s["at"] for s in stamps(passed)] == ["a", "old-b"]


def test_a_deprecated_patch_replays_runs_that_took_it_and_journals_nothing_new(monkeypatch):
    monkeypatch.setenv("K2B_TEST_PATCH", "new")
    DomainRow.objects.create(key="took-k1")
    took = park("ver.patched", {"k1": "took-k1", "k2": "took-k2"})
    monkeypatch.setenv("K2B_TEST_PATCH", "deprecated")
    DomainRow.objects.create(key="later-k1")
    later = park("ver.patched", {"k1": "later-k1", "k2": "later-k2"})
    wake("took-k2")
    wake("later-k2")
    run_to_end()
    assert fresh(took).output == {"branch": "new"}, describe(took)
    assert fresh(later).output == {"branch": "new"}, describe(later)
    assert markers(took) == [2] and markers(later) == []


def test_removing_a_patch_call_too_early_is_nondeterminism_that_names_the_patch(monkeypatch):
    monkeypatch.setenv("K2B_TEST_PATCH", "new")
    DomainRow.objects.create(key="early-k1")
    run = park("ver.patched", {"k1": "early-k1", "k2": "early-k2"})
    monkeypatch.setenv("K2B_TEST_PATCH", "old")  # the patch call deleted, old branch kept
    wake("early-k2")
    run_to_end()
    state = describe(run)
    assert (state["status"], state["code"]) == ("needs_attention", WORKFLOW_NONDETERMINISTIC)
    assert f"run.deprecate_patch('{PATCH_ID}')" in state["message"]


# Nondeterminism ----------------------------------------------------------------------------


def reordered_incident(monkeypatch) -> WorkflowRun:
    monkeypatch.delenv("K2B_TEST_REORDERED", raising=False)
    run = park("ver.reordered", {"key": "reorder"})
    monkeypatch.setenv("K2B_TEST_REORDERED", "1")
    wake("reorder")
    run_to_end()
    assert fresh(run).status == "needs_attention", describe(run)
    return fresh(run)


def test_a_diverging_replay_keeps_both_sides_as_hashes_and_runs_nothing(monkeypatch):
    run = reordered_incident(monkeypatch)
    first = journal(run)[0]
    assert run.error_code == WORKFLOW_NONDETERMINISTIC
    detail = run.error_detail
    assert detail["seq"] == 0
    assert detail["journaled"] == {
        "action": "ver.stamp",
        "effect": "pure",
        "state": "succeeded",
        "input_hash": first.input_hash,
    }
    assert detail["asked"] == {
        "action": "test.wait_for",
        "input_hash": evidence.hash_value({"key": "reorder"}),
    }
    assert "reorder" not in str(detail)  # hashes only, never the inputs
    assert [s["at"] for s in stamps(run)] == ["a"]


def test_the_nondeterminism_page_shows_both_steps_and_offers_retry_and_cancel_only(
    monkeypatch,
):
    run = reordered_incident(monkeypatch)
    operator = make_user(
        "nora", "view_workflowrun", "resolve_effect", "retry_workflowrun", "cancel_workflowrun"
    )
    client = client_for(operator)
    html = client.get(run_url(run)).content.decode()
    assert "The workflow code no longer matches the journal" in html
    assert "ver.stamp" in html and "test.wait_for" in html
    assert run.error_detail["asked"]["input_hash"][:16] in html
    assert reverse("admin:k2b_workflows_workflowrun_retry", args=[run.pk]) in html
    assert reverse("admin:k2b_workflows_workflowrun_cancel", args=[run.pk]) in html
    resolve = reverse("admin:k2b_workflows_incident_resolve", args=[run.pk])
    assert resolve not in html
    queue = client.get(reverse("admin:k2b_workflows_incident_changelist")).content.decode()
    assert "Retry…" in queue and resolve not in queue
    # Typed in by hand, the resolution form says where the actions are, not "Nothing changed".
    response = client.get(resolve, follow=True)
    text = " ".join(str(m) for m in response.context["messages"])
    assert "not a decision on an effect" in text and "Nothing changed" not in text


def test_retry_after_deploying_the_fix_replays_the_run_to_the_end(monkeypatch):
    run = reordered_incident(monkeypatch)
    operator = make_user("rita", "view_workflowrun", "retry_workflowrun")
    monkeypatch.setenv("K2B_TEST_REORDERED", "0")  # the fix: the original order back
    client = client_for(operator)
    url = reverse("admin:k2b_workflows_workflowrun_retry", args=[run.pk])
    assert "Yes, retry now" in client.get(url).content.decode()
    client.post(url, {"post": "yes", "reason": "deployed the fix"})
    assert fresh(run).status == "queued"
    run_to_end()
    done = fresh(run)
    assert (done.status, done.error_detail) == ("succeeded", None), describe(run)
    assert [s["at"] for s in stamps(run)] == ["a", "b"]  # step 0 was not run again


# Workflow code that raises -----------------------------------------------------------------


def test_workflow_code_that_raises_needs_attention_once_with_its_traceback(monkeypatch):
    monkeypatch.delenv("K2B_TEST_BUG_FIXED", raising=False)
    run = start_workflow_run("ver.buggy", {})
    stats = run_to_end()
    state = fresh(run)
    assert (state.status, state.error_code) == ("needs_attention", WORKFLOW_CODE_ERROR)
    assert stats["runs"] == 1  # no retries with backoff
    assert state.consecutive_failures == 0
    assert "KeyError" in state.error_message
    trace = state.error_detail["traceback"]
    assert trace.startswith("Traceback") and "buggy_workflow" in trace
    assert 'first["at"]' in trace


def test_a_code_error_is_retried_by_an_operator_once_the_fix_is_deployed(monkeypatch):
    monkeypatch.delenv("K2B_TEST_BUG_FIXED", raising=False)
    run = start_workflow_run("ver.buggy", {})
    run_to_end()
    operator = User.objects.create_user("otto", is_staff=True)
    with pytest.raises(Exception, match="permission"):
        retry_workflow_run(run.pk, actor=operator, reason="fixed")
    operator = make_user("otto2", "retry_workflowrun")
    monkeypatch.setenv("K2B_TEST_BUG_FIXED", "1")
    retry_workflow_run(run.pk, actor=operator, reason="fixed in 1.2.3")
    run_to_end()
    done = fresh(run)
    assert (done.status, done.output) == ("succeeded", {"at": "before-bug"})
    assert len(stamps(run)) == 1  # the journaled step was replayed, not run again


def test_an_action_that_raises_is_still_a_retryable_step_failure():
    run = start_workflow_run("test.flaky", {"times": 1, "how": "raise"})
    run_to_end()
    assert fresh(run).status == "succeeded", describe(run)


def test_retry_is_refused_for_an_effect_in_doubt():
    run = start_workflow_run("test.charge_blind", {"behaviour": "ambiguous"})
    run_to_end()
    operator = make_user("uma", "retry_workflowrun")
    with pytest.raises(NotRetryable, match="decide on the effect"):
        retry_workflow_run(run.pk, actor=operator)
    assert JournalEntry.objects.filter(run=run).count() == 0


def test_a_run_parked_in_the_step_a_patch_replaces_keeps_the_old_branch(monkeypatch):
    monkeypatch.setenv("K2B_TEST_PATCH", "old")
    run = park("ver.patched_at_wait", {"key": "at-wait"})
    monkeypatch.setenv("K2B_TEST_PATCH", "new")
    fresh_run = start_workflow_run("ver.patched_at_wait", {"key": "unused"})
    wake("at-wait")
    run_to_end()
    assert fresh(run).output == {"branch": "old"}, describe(run)
    assert fresh(fresh_run).output == {"branch": "new"}, describe(fresh_run)
    assert [e.action_name for e in journal(run)] == ["ver.stamp", "test.wait_for"]


# Every incident code: its page offers only actions that act ------------------------------


def incident_with(code: str, attention_step: int | None = None) -> WorkflowRun:
    """A run put in ``needs_attention`` with ``code`` through the transitions the kernel uses."""
    from django.db import connection

    run = start_workflow_run("ver.checkout", {"key": "never"})
    with connection.cursor() as cursor:
        cursor.execute("UPDATE k2b_run SET status = 'running' WHERE id = %s", [run.pk])
        cursor.execute(
            """UPDATE k2b_run SET status = 'needs_attention', error_code = %s,
                      error_message = 'made by the test', attention_step = %s WHERE id = %s""",
            [code, attention_step, run.pk],
        )
    return fresh(run)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (WORKFLOW_NONDETERMINISTIC, ["Retry…", "Cancel…"]),
        (WORKFLOW_CODE_ERROR, ["Retry…", "Cancel…"]),
        ("INTEGRITY_CHAIN_BROKEN", ["Retry…", "Cancel…"]),
        ("EFFECT_OUTCOME_UNKNOWN", ["Cancel…"]),  # no step in doubt: nothing to resolve
        (("EFFECT_OUTCOME_UNKNOWN", 0), ["Resolve the effect…", "Cancel…"]),
        ("SOMETHING_ELSE", ["Cancel…"]),
    ],
)
def test_every_incident_page_offers_only_actions_that_change_the_run(code, expected):
    import re

    run = incident_with(*code) if isinstance(code, tuple) else incident_with(code)
    operator = make_user(
        "ida", "view_workflowrun", "resolve_effect", "retry_workflowrun", "cancel_workflowrun"
    )
    client = client_for(operator)
    html = client.get(run_url(run)).content.decode()
    box = html[
        html.index('id="k2b-incident"') : html.index("</fieldset>", html.index("k2b-incident"))
    ]
    links = re.findall(r'<a class="button [^"]+" href="([^"]+)">([^<]+)</a>', box)
    assert [text for _, text in links] == expected
    queue = client.get(reverse("admin:k2b_workflows_incident_changelist")).content.decode()
    for url, text in links:
        assert url in queue
        page = client.get(url).content.decode()
        # The confirmation lists the run as one it will act on, never as left alone.
        assert "Left as they are" not in page and "Nothing changed" not in page, text
        if text.startswith("Resolve"):
            assert "Resolve step 0" in page  # the form itself; tests/admin/test_admin.py submits it
            continue
        client.post(url, {"post": "yes", "reason": f"{text} by the test"})
        after = fresh(run)
        assert after.status == ("queued" if text == "Retry…" else "canceled"), text
        if text == "Retry…":
            assert (after.error_code, after.error_detail) == ("", None)
            break
