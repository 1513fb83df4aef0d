"""The operators' admin, through Django's test client: every view and permission rule.

Incidents are made for real: a run of ``test.charge_blind`` whose provider
answers ambiguously, executed by ``run_until_idle``, ends ``needs_attention``.
"""

from __future__ import annotations

import re
import threading
from datetime import timedelta
from html import unescape

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from k2b_workflows import start_workflow_run
from k2b_workflows.admin.display import build_timeline
from k2b_workflows.models import JournalEntry, LedgerEntry, WorkflowRun
from k2b_workflows.store import WORKFLOW_RETRY_EXHAUSTED
from k2b_workflows.testing import run_until_idle
from tests.support.admin import (
    OPERATOR_PERMS,
    client_for,
    make_incident,
    make_user,
    messages_of,
    resolution_data,
    resolve_url,
    run_url,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def viewer() -> User:
    return make_user("victor", "view_workflowrun")


@pytest.fixture
def admin_user() -> User:
    return make_user("root", superuser=True)


# Runs changelist -------------------------------------------------------------------------


def test_runs_changelist_shows_status_badge_and_columns(viewer):
    run = make_incident()
    response = client_for(viewer).get(reverse("admin:k2b_workflows_workflowrun_changelist"))
    assert response.status_code == 200
    html = response.content.decode()
    assert 'class="k2b-badge k2b-status-needs_attention"' in html
    assert str(run.pk)[:8] in html
    for header in ("workflow name", "app id", "step", "gen.", "failures", "age"):
        assert header in html.lower()


def test_runs_changelist_filters_by_status(viewer):
    incident = make_incident()
    done = start_workflow_run("test.pure", {"a": 1, "b": 2})
    run_until_idle()
    url = reverse("admin:k2b_workflows_workflowrun_changelist")
    response = client_for(viewer).get(url, {"status__exact": "succeeded"})
    runs = list(response.context["cl"].result_list)
    assert [r.pk for r in runs] == [done.pk]
    assert incident.pk not in [r.pk for r in runs]


def test_runs_search_finds_a_run_by_its_full_id(viewer):
    wanted = start_workflow_run("test.pure", {"a": 1, "b": 2})
    start_workflow_run("test.pure", {"a": 3, "b": 4})
    url = reverse("admin:k2b_workflows_workflowrun_changelist")
    response = client_for(viewer).get(url, {"q": str(wanted.pk)})
    assert [r.pk for r in response.context["cl"].result_list] == [wanted.pk]


def test_runs_search_finds_a_run_by_idempotency_key(viewer):
    wanted = start_workflow_run("test.pure", {"a": 1, "b": 2}, idempotency_key="order-42")
    start_workflow_run("test.pure", {"a": 1, "b": 2}, idempotency_key="order-43")
    url = reverse("admin:k2b_workflows_workflowrun_changelist")
    response = client_for(viewer).get(url, {"q": "order-42"})
    assert [r.pk for r in response.context["cl"].result_list] == [wanted.pk]


def test_runs_cannot_be_added_or_deleted_even_by_a_superuser(admin_user):
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    client = client_for(admin_user)
    assert client.get(reverse("admin:k2b_workflows_workflowrun_add")).status_code == 403
    delete = reverse("admin:k2b_workflows_workflowrun_delete", args=[run.pk])
    assert client.post(delete, {"post": "yes"}).status_code == 403
    assert WorkflowRun.objects.filter(pk=run.pk).exists()


def test_run_page_is_read_only(admin_user):
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    client = client_for(admin_user)
    response = client.get(run_url(run))
    assert response.status_code == 200
    assert not response.context["adminform"].form.fields
    client.post(run_url(run), {"workflow_name": "changed", "status": "succeeded"})
    run.refresh_from_db()
    assert (run.workflow_name, run.status) == ("test.pure", "queued")


def test_run_page_shows_input_output_timeline_ledger_and_budget(viewer):
    run = start_workflow_run("test.charge", {"amount": 700})
    run_until_idle()
    response = client_for(viewer).get(run_url(run))
    html = unescape(response.content.decode())
    assert '"amount": 700' in html
    assert "charge_id" in html
    bars = response.context["timeline"].bars
    assert [(b.seq, b.action, b.effect, b.state) for b in bars] == [
        (0, "test.charge", "external", "succeeded")
    ]
    assert [e.kind for e in response.context["ledger"]] == ["dispatched", "succeeded"]
    dispatched = response.context["ledger"][0]
    assert dispatched.input_hash[:12] in html and dispatched.invocation_key in html
    charges = {line.label: (line.spent, line.limit) for line in response.context["budget_lines"]}
    assert charges["charges"] == (1, 2)


def test_run_page_marks_the_step_an_incident_stopped_in(viewer):
    run = make_incident()
    response = client_for(viewer).get(run_url(run))
    (bar,) = response.context["timeline"].bars
    assert (bar.seq, bar.action, bar.state, bar.stopped) == (
        0,
        "test.charge_blind",
        "needs attention",
        True,
    )
    assert "stopped here" in response.content.decode()


def test_run_page_shows_what_a_waiting_run_waits_for(viewer):
    run = start_workflow_run("test.wait", {"key": "parcel-7"})
    run_until_idle()
    run.refresh_from_db()
    assert run.status == "waiting"
    html = client_for(viewer).get(run_url(run)).content.decode()
    assert "Waiting for" in html
    assert "parcel-7" in html and run.wait_kind in html


def test_a_run_that_waited_and_ended_shows_what_it_last_waited_for_not_waiting_for(viewer):
    """A succeeded run's page said "Waiting for: k2b.ai_task" (#38)."""
    from k2b_workflows import wake_workflow_runs_waiting_on
    from tests.models import DomainRow

    run = start_workflow_run("test.wait", {"key": "parcel-8"})
    run_until_idle()
    DomainRow.objects.create(key="parcel-8", value="here")
    wake_workflow_runs_waiting_on(app_id="tests", kind="signal", key="parcel-8")
    run_until_idle()
    run.refresh_from_db()
    assert run.status == "succeeded" and run.wait_kind  # the last wait is kept
    html = client_for(viewer).get(run_url(run)).content.decode()
    assert "Waiting for" not in html
    assert "Last waited for" in html and "parcel-8" in html


def test_run_page_counts_children_per_status(viewer):
    parent = start_workflow_run("test.pure", {"a": 1, "b": 2})
    start_workflow_run("test.pure", {"a": 1, "b": 1}, parent=parent)
    start_workflow_run("test.pure", {"a": 2, "b": 2}, parent=parent)
    response = client_for(viewer).get(run_url(parent))
    assert response.context["child_total"] == 2
    assert response.context["child_counts"] == {"queued": 2}


def test_principal_is_shown_only_as_a_hash(viewer):
    run = start_workflow_run("test.pure", {"a": 1, "b": 2}, principal={"email": "a@b.example"})
    html = client_for(viewer).get(run_url(run)).content.decode()
    assert "a@b.example" not in html
    assert "principal (hash)" in html.lower()


def test_timeline_bars_are_proportional_to_step_durations():
    t0 = timezone.now()
    run = WorkflowRun(created_at=t0, updated_at=t0, status="succeeded")
    journal = [
        JournalEntry(
            seq=0,
            action_name="a",
            effect="pure",
            state="succeeded",
            started_at=t0,
            created_at=t0 + timedelta(seconds=1),
        ),
        JournalEntry(
            seq=1,
            action_name="b",
            effect="external",
            state="succeeded",
            started_at=t0 + timedelta(seconds=1),
            created_at=t0 + timedelta(seconds=4),
        ),
    ]
    timeline = build_timeline(run, journal, [])
    assert [(b.offset_pct, b.width_pct) for b in timeline.bars] == [(0.0, 25.0), (25.0, 75.0)]


# Incidents -------------------------------------------------------------------------------


def test_incident_queue_lists_only_runs_that_need_attention_oldest_first(operator):
    first = make_incident()
    second = make_incident()
    start_workflow_run("test.pure", {"a": 1, "b": 2})
    run_until_idle()
    response = client_for(operator).get(reverse("admin:k2b_workflows_incident_changelist"))
    assert [r.pk for r in response.context["cl"].result_list] == [first.pk, second.pk]


def test_incident_queue_shows_step_action_effect_answers_and_hashes(operator):
    run = make_incident()
    dispatched = LedgerEntry.objects.get(run=run, kind="dispatched")
    response = client_for(operator).get(reverse("admin:k2b_workflows_incident_changelist"))
    html = response.content.decode()
    assert "test.charge_blind" in html
    assert "external" in html
    assert "reconcile_unknown" in html and "the action has no reconcile()" in html
    assert dispatched.definition_hash[:12] in html and dispatched.input_hash[:12] in html
    assert resolve_url(run) in html


def test_incident_queue_hides_resolve_link_without_permission(viewer):
    run = make_incident()
    response = client_for(viewer).get(reverse("admin:k2b_workflows_incident_changelist"))
    assert response.status_code == 200
    assert resolve_url(run) not in response.content.decode()


def test_resolution_form_is_forbidden_without_permission(viewer):
    run = make_incident()
    client = client_for(viewer)
    assert client.get(resolve_url(run)).status_code == 403
    response = client.post(
        resolve_url(run), {**resolution_data(run, "effect_absent"), "_confirm": "1"}
    )
    assert response.status_code == 403
    run.refresh_from_db()
    assert run.status == "needs_attention"


def test_run_page_offers_resolution_only_with_permission(operator, viewer):
    run = make_incident()
    assert resolve_url(run) in client_for(operator).get(run_url(run)).content.decode()
    assert resolve_url(run) not in client_for(viewer).get(run_url(run)).content.decode()


def test_resolution_asks_for_confirmation_before_changing_anything(operator):
    run = make_incident()
    response = client_for(operator).post(resolve_url(run), resolution_data(run, "effect_absent"))
    assert response.status_code == 200
    assert response.context["confirming"] is True
    assert "Yes, record this decision" in response.content.decode()
    run.refresh_from_db()
    assert run.status == "needs_attention"


def test_confirmed_absent_resolution_requeues_the_run_and_names_the_operator(operator):
    run = make_incident()
    data = {**resolution_data(run, "effect_absent"), "_confirm": "1"}
    response = client_for(operator).post(resolve_url(run), data, follow=True)
    run.refresh_from_db()
    assert run.status == "queued"
    entry = LedgerEntry.objects.get(run=run, kind="resolved_absent")
    assert (entry.actor, entry.evidence) == ("olga", data["evidence"])
    assert any("effect absent recorded" in m for m in messages_of(response))
    assert response.redirect_chain[-1][0] == run_url(run)


def test_resolution_is_written_to_the_admin_log_naming_the_decision(operator):
    run = make_incident()
    client_for(operator).post(
        resolve_url(run),
        {
            **resolution_data(run, "effect_confirmed", output='{"charge_id": "ch_9"}'),
            "_confirm": "1",
        },
    )
    log = LogEntry.objects.get(object_id=str(run.pk))
    assert (log.user_id, log.action_flag) == (operator.pk, CHANGE)
    assert "effect confirmed" in log.get_change_message()


def test_confirmed_effect_journals_the_given_output(operator):
    run = make_incident()
    data = {
        **resolution_data(run, "effect_confirmed", output='{"charge_id": "ch_9"}'),
        "_confirm": "1",
    }
    client_for(operator).post(resolve_url(run), data)
    entry = JournalEntry.objects.get(run=run, seq=0)
    assert (entry.state, entry.output) == ("succeeded", {"charge_id": "ch_9"})
    run_until_idle()
    run.refresh_from_db()
    assert (run.status, run.output) == ("succeeded", {"charge_id": "ch_9"})


def test_malformed_output_json_is_a_form_error_and_nothing_changes(operator):
    run = make_incident()
    ledger_before = LedgerEntry.objects.filter(run=run).count()
    data = {**resolution_data(run, "effect_confirmed", output='{"charge_id": '), "_confirm": "1"}
    response = client_for(operator).post(resolve_url(run), data)
    assert response.status_code == 200
    assert "not valid JSON" in str(response.context["form"].errors["output"])
    run.refresh_from_db()
    assert run.status == "needs_attention"
    assert LedgerEntry.objects.filter(run=run).count() == ledger_before
    assert not JournalEntry.objects.filter(run=run).exists()


def test_confirmed_effect_without_output_is_a_form_error(operator):
    run = make_incident()
    data = {**resolution_data(run, "effect_confirmed", output=""), "_confirm": "1"}
    response = client_for(operator).post(resolve_url(run), data)
    assert "output" in response.context["form"].errors
    run.refresh_from_db()
    assert run.status == "needs_attention"


def test_resolution_without_evidence_is_a_form_error(operator):
    run = make_incident()
    data = {**resolution_data(run, "effect_absent", evidence="   "), "_confirm": "1"}
    response = client_for(operator).post(resolve_url(run), data)
    assert "evidence" in response.context["form"].errors
    run.refresh_from_db()
    assert run.status == "needs_attention"


def test_resolution_of_a_run_that_needs_none_is_refused(operator):
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    run_until_idle()
    client = client_for(operator)
    response = client.get(resolve_url(run), follow=True)
    assert any("not waiting for a decision" in m for m in messages_of(response))
    data = {"decision": "effect_absent", "evidence": "checked", "_confirm": "1"}
    client.post(resolve_url(run), data)
    run.refresh_from_db()
    assert run.status == "succeeded"
    assert not LedgerEntry.objects.filter(run=run, kind__startswith="resolved").exists()


def test_second_operator_is_told_who_resolved_first(operator):
    run = make_incident()
    other = make_user("bob", *OPERATOR_PERMS)
    first, second = client_for(operator), client_for(other)
    # Both fill in the form against the same evidence, then both confirm.
    absent = {**resolution_data(run, "effect_absent"), "_confirm": "1"}
    confirmed = {
        **resolution_data(run, "effect_confirmed", output='{"charge_id": "x"}'),
        "_confirm": "1",
    }
    first.post(resolve_url(run), absent)
    response = second.post(resolve_url(run), confirmed, follow=True)
    assert response.status_code == 200
    text = " ".join(messages_of(response))
    assert "olga already resolved step 0" in text and "effect absent" in text
    assert LedgerEntry.objects.filter(run=run, kind__startswith="resolved").count() == 1


def test_concurrent_confirmations_apply_exactly_one_decision(operator):
    run = make_incident()
    other = make_user("bob", *OPERATOR_PERMS)
    data = {**resolution_data(run, "effect_absent"), "_confirm": "1"}
    clients = [client_for(operator), client_for(other)]
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def confirm(client: Client) -> None:
        from django.db import connection

        try:
            barrier.wait()
            client.post(resolve_url(run), data)
        finally:
            connection.close()

    threads = [threading.Thread(target=confirm, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Each operator's message waits in their session; read them one after the other.
    outcomes = [" ".join(messages_of(c.get(run_url(run)))) for c in clients]
    assert LedgerEntry.objects.filter(run=run, kind="resolved_absent").count() == 1
    assert sum("recorded" in o for o in outcomes) == 1
    assert sum("already resolved" in o for o in outcomes) == 1


def test_decision_on_evidence_of_an_earlier_dispatch_is_not_applied(operator):
    run = make_incident()
    stale = {
        **resolution_data(run, "effect_confirmed", output='{"charge_id": "old"}'),
        "_confirm": "1",
    }
    client = client_for(operator)
    client.post(resolve_url(run), {**resolution_data(run, "effect_absent"), "_confirm": "1"})
    run_until_idle()  # the step runs again and is ambiguous again: a new incident
    run.refresh_from_db()
    assert run.status == "needs_attention"
    response = client.post(resolve_url(run), stale, follow=True)
    assert any("New evidence arrived" in m for m in messages_of(response))
    run.refresh_from_db()
    assert run.status == "needs_attention"
    assert not LedgerEntry.objects.filter(run=run, kind="resolved_confirmed").exists()


# Cancel and retry ------------------------------------------------------------------------


def changelist_action(client: Client, action: str, runs: list[WorkflowRun], **extra: str):
    url = reverse("admin:k2b_workflows_workflowrun_changelist")
    data = {"action": action, "_selected_action": [str(r.pk) for r in runs], "index": "0", **extra}
    return client.post(url, data)


def confirm_action(client: Client, action: str, runs: list[WorkflowRun], **extra: str):
    url = reverse("admin:k2b_workflows_workflowrun_changelist")
    data = {"action": action, "_selected_action": [str(r.pk) for r in runs], "post": "yes", **extra}
    return client.post(url, data, follow=True)


def exhausted_run(settings) -> WorkflowRun:
    settings.K2B_WORKFLOWS = {
        **settings.K2B_WORKFLOWS,
        "RUN_MAX_CONSECUTIVE_FAILURES": 1,
        "RETRY_BACKOFF_MS": 1,
    }
    run = start_workflow_run("test.flaky", {"times": 100})
    run_until_idle()
    run.refresh_from_db()
    assert (run.status, run.error_code) == ("failed", WORKFLOW_RETRY_EXHAUSTED)
    return run


def test_cancel_action_shows_a_confirmation_page_first():
    user = make_user("carl", "view_workflowrun", "cancel_workflowrun")
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    response = changelist_action(client_for(user), "cancel_runs", [run])
    assert response.status_code == 200
    assert response.context["eligible"] == [run]
    assert "Yes, cancel" in response.content.decode()
    run.refresh_from_db()
    assert run.status == "queued"


def test_cancel_action_cancels_with_the_reason_and_logs_it():
    user = make_user("carl", "view_workflowrun", "cancel_workflowrun")
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    confirm_action(client_for(user), "cancel_runs", [run], reason="customer withdrew")
    run.refresh_from_db()
    assert (run.status, run.error_code) == ("canceled", "CANCELED")
    assert "customer withdrew" in run.error_message
    assert "customer withdrew" in LogEntry.objects.get(object_id=str(run.pk)).get_change_message()


def test_cancel_without_a_reason_is_a_form_error():
    user = make_user("carl", "view_workflowrun", "cancel_workflowrun")
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    url = reverse("admin:k2b_workflows_workflowrun_changelist")
    response = client_for(user).post(
        url,
        {"action": "cancel_runs", "_selected_action": [str(run.pk)], "post": "yes", "reason": " "},
    )
    assert "reason" in response.context["form"].errors
    run.refresh_from_db()
    assert run.status == "queued"


def test_cancel_and_retry_actions_are_offered_only_with_their_permission(viewer):
    url = reverse("admin:k2b_workflows_workflowrun_changelist")
    start_workflow_run("test.pure", {"a": 1, "b": 2})
    canceller = make_user("carl", "view_workflowrun", "cancel_workflowrun")
    html = client_for(canceller).get(url).content.decode()
    assert 'value="cancel_runs"' in html and 'value="retry_runs"' not in html
    html = client_for(viewer).get(url).content.decode()
    assert 'value="cancel_runs"' not in html and 'value="retry_runs"' not in html


def test_cancel_button_of_a_run_page_is_forbidden_without_permission(viewer):
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    url = reverse("admin:k2b_workflows_workflowrun_cancel", args=[run.pk])
    assert client_for(viewer).post(url, {"post": "yes", "reason": "x"}).status_code == 403
    run.refresh_from_db()
    assert run.status == "queued"


def test_cancel_button_of_a_run_page_confirms_then_cancels():
    user = make_user("carl", "view_workflowrun", "cancel_workflowrun")
    run = make_incident()
    url = reverse("admin:k2b_workflows_workflowrun_cancel", args=[run.pk])
    client = client_for(user)
    assert "Yes, cancel" in client.get(url).content.decode()
    response = client.post(url, {"post": "yes", "reason": "duplicate order"})
    assert response.url == run_url(run)
    run.refresh_from_db()
    assert run.status == "canceled"


def test_retry_action_requeues_a_run_that_exhausted_its_retries(settings):
    run = exhausted_run(settings)
    user = make_user("rita", "view_workflowrun", "retry_workflowrun")
    client = client_for(user)
    page = changelist_action(client, "retry_runs", [run])
    assert page.context["eligible"] == [run]
    confirm_action(client, "retry_runs", [run], reason="provider is back")
    run.refresh_from_db()
    assert (run.status, run.consecutive_failures) == ("queued", 0)
    assert LedgerEntry.objects.get(run=run, kind="retried").actor == "rita"


def test_retry_leaves_runs_that_did_not_exhaust_retries():
    user = make_user("rita", "view_workflowrun", "retry_workflowrun")
    run = make_incident()
    response = changelist_action(client_for(user), "retry_runs", [run])
    assert response.context["eligible"] == []
    assert [r for r, _ in response.context["skipped"]] == [run]
    confirm_action(client_for(user), "retry_runs", [run], reason="try")
    run.refresh_from_db()
    assert run.status == "needs_attention"


def test_retry_button_is_forbidden_without_permission(settings):
    run = exhausted_run(settings)
    user = make_user("carl", "view_workflowrun", "cancel_workflowrun")
    url = reverse("admin:k2b_workflows_workflowrun_retry", args=[run.pk])
    assert client_for(user).post(url, {"post": "yes", "reason": "x"}).status_code == 403
    run.refresh_from_db()
    assert run.status == "failed"


# Journal and ledger ----------------------------------------------------------------------


@pytest.mark.parametrize("model", ["journalentry", "ledgerentry"])
def test_journal_and_ledger_cannot_be_edited_or_deleted_in_the_admin(admin_user, model):
    run = start_workflow_run("test.charge", {"amount": 5})
    run_until_idle()
    obj = (JournalEntry if model == "journalentry" else LedgerEntry).objects.filter(run=run)[0]
    client = client_for(admin_user)
    assert client.get(reverse(f"admin:k2b_workflows_{model}_add")).status_code == 403
    change = reverse(f"admin:k2b_workflows_{model}_change", args=[obj.pk])
    page = client.get(change)
    assert page.status_code == 200 and not page.context["adminform"].form.fields
    delete = reverse(f"admin:k2b_workflows_{model}_delete", args=[obj.pk])
    assert client.post(delete, {"post": "yes"}).status_code == 403


# Dry run ---------------------------------------------------------------------------------


@pytest.fixture
def planner() -> User:
    return make_user("paula", "view_workflowrun", "dry_run_workflow")


def test_dry_run_shows_the_steps_and_cost_against_the_budget(planner):
    url = reverse("admin:k2b_workflows_workflowrun_dry_run")
    response = client_for(planner).post(url, {"workflow": "test.charge", "input": '{"amount": 9}'})
    report = response.context["report"]
    assert [(s.seq, s.action) for s in report.steps] == [(0, "test.charge")]
    assert response.context["budget_rows"] == [("charges", 1, 2)]
    html = response.content.decode()
    assert "Charge 9" in html and "would run" in html
    assert '"planned": true' in unescape(html)


def test_dry_run_with_malformed_input_is_a_form_error(planner):
    url = reverse("admin:k2b_workflows_workflowrun_dry_run")
    response = client_for(planner).post(url, {"workflow": "test.charge", "input": "{amount"})
    assert "input" in response.context["form"].errors
    assert response.context["report"] is None


def test_dry_run_is_forbidden_without_view_permission():
    user = make_user("nobody", "cancel_workflowrun")
    url = reverse("admin:k2b_workflows_workflowrun_dry_run")
    assert client_for(user).get(url).status_code == 403


def test_dry_run_needs_its_own_permission_beyond_viewing_runs(viewer, planner):
    url = reverse("admin:k2b_workflows_workflowrun_dry_run")
    assert client_for(viewer).get(url).status_code == 403
    changelist = reverse("admin:k2b_workflows_workflowrun_changelist")
    assert url not in client_for(viewer).get(changelist).content.decode()
    assert url in client_for(planner).get(changelist).content.decode()


# Content-Security-Policy -----------------------------------------------------------------

INLINE = re.compile(r"<script(?![^>]*\bsrc=)[^>]*>|\son[a-z]+\s*=|\sstyle\s*=", re.IGNORECASE)


def test_operator_pages_have_no_inline_scripts_handlers_or_styles():
    run = make_incident()
    client = client_for(make_user("olga", *OPERATOR_PERMS, "dry_run_workflow"))
    pages = [
        run_url(run),
        reverse("admin:k2b_workflows_incident_changelist"),
        resolve_url(run),
        reverse("admin:k2b_workflows_workflowrun_dry_run"),
    ]
    for url in pages:
        html = client.get(url).content.decode()
        ours = html.split('id="content"', 1)[1]  # the admin's own chrome is not ours to judge
        assert not INLINE.findall(ours), url
    confirm = client.post(resolve_url(run), resolution_data(run, "effect_absent"))
    assert not INLINE.findall(confirm.content.decode().split('id="content"', 1)[1])
