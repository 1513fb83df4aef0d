"""The admin against careless and hostile input: strict resolutions, no 500s, bounded pages.

Every refusal is checked twice: the answer the operator sees, and that the
database is exactly as before.
"""

from __future__ import annotations

import json
from html import unescape

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from k2b_workflows import (
    EFFECT_ABSENT,
    EvidenceChanged,
    ResolutionRefused,
    resolve_effect,
    start_workflow_run,
)
from k2b_workflows.admin.display import INPUT_SHOWN_BYTES, INPUT_SHOWN_CHARS
from k2b_workflows.models import JournalEntry, LedgerEntry, WorkflowRun
from k2b_workflows.testing import run_until_idle
from tests.support.admin import (
    client_for,
    head_ledger_id,
    make_incident,
    make_user,
    messages_of,
    resolution_data,
    resolve_url,
    run_url,
)

pytestmark = pytest.mark.django_db(transaction=True)


def snapshot(run: WorkflowRun) -> tuple:
    """Everything a resolution could change."""
    row = WorkflowRun.objects.filter(pk=run.pk).values().get()
    return (
        row,
        list(LedgerEntry.objects.filter(run=run).values_list("id", flat=True)),
        list(JournalEntry.objects.filter(run=run).values_list("id", flat=True)),
    )


def confirm(client, run, data):
    return client.post(resolve_url(run), {**data, "_confirm": "1"})


# -- strict resolution (#9) -----------------------------------------------------------


@pytest.mark.parametrize("missing", ["seen_ledger_id", "step"])
def test_a_decision_without_evidence_version_or_step_is_refused_and_changes_nothing(
    operator, missing
):
    run = make_incident()
    before = snapshot(run)
    data = resolution_data(run, EFFECT_ABSENT)
    del data[missing]
    response = confirm(client_for(operator), run, data)
    assert response.status_code == 200
    errors = " ".join(response.context["form"].non_field_errors())
    assert "seen_ledger_id and step are required" in errors
    assert snapshot(run) == before


@pytest.mark.parametrize("bad", ["abc", "-1", "1e3"])
def test_a_malformed_evidence_version_is_refused_and_changes_nothing(operator, bad):
    run = make_incident()
    before = snapshot(run)
    response = confirm(client_for(operator), run, resolution_data(run, EFFECT_ABSENT, step=bad))
    assert "seen_ledger_id and step are required" in unescape(response.content.decode())
    assert snapshot(run) == before


def test_a_decision_about_another_step_is_refused_and_changes_nothing(operator):
    run = make_incident()
    before = snapshot(run)
    data = resolution_data(run, EFFECT_ABSENT, step=str(run.attention_step + 1))
    response = client_for(operator).post(resolve_url(run), {**data, "_confirm": "1"}, follow=True)
    assert any("needs a decision on step 0, not on step 1" in m for m in messages_of(response))
    assert snapshot(run) == before


def test_resolve_effect_compares_step_and_evidence_version_under_the_lock(operator):
    run = make_incident()
    before = snapshot(run)
    head = head_ledger_id(run)
    with pytest.raises(EvidenceChanged):
        resolve_effect(
            run.pk, EFFECT_ABSENT, evidence="x", actor=operator, step=0, seen_ledger_id=head - 1
        )
    with pytest.raises(ResolutionRefused):
        resolve_effect(
            run.pk, EFFECT_ABSENT, evidence="x", actor=operator, step=1, seen_ledger_id=head
        )
    assert snapshot(run) == before
    resolve_effect(run.pk, EFFECT_ABSENT, evidence="x", actor=operator, step=0, seen_ledger_id=head)
    assert WorkflowRun.objects.get(pk=run.pk).status == "queued"


def test_evidence_that_arrived_after_the_form_was_shown_refuses_the_decision(operator):
    run = make_incident()
    data = resolution_data(run, EFFECT_ABSENT, seen_ledger_id=str(head_ledger_id(run) - 1))
    before = snapshot(run)
    response = client_for(operator).post(resolve_url(run), {**data, "_confirm": "1"}, follow=True)
    assert any("New evidence arrived" in m for m in messages_of(response))
    assert snapshot(run) == before


# -- malformed ids (#11) --------------------------------------------------------------


@pytest.mark.parametrize("bad", ["not-a-uuid", "1", "zzz%00", "' OR 1=1 --"])
def test_malformed_run_ids_in_admin_urls_are_404(bad):
    root = make_user("root", superuser=True)
    client = client_for(root)
    base = "/admin/k2b_workflows"
    for url in (
        f"{base}/workflowrun/{bad}/change/",
        f"{base}/workflowrun/{bad}/cancel/",
        f"{base}/workflowrun/{bad}/retry/",
        f"{base}/incident/{bad}/resolve/",
        f"{base}/incident/{bad}/change/",
    ):
        assert client.get(url).status_code == 404, url
        assert client.post(url, {"post": "yes", "reason": "r"}).status_code == 404, url


def test_an_unknown_but_well_formed_run_id_is_404():
    root = make_user("root", superuser=True)
    url = reverse("admin:k2b_workflows_workflowrun_change", args=["0" * 32])
    assert client_for(root).get(url).status_code == 404


@pytest.mark.parametrize("name", ["workflowrun", "incident", "journalentry", "ledgerentry"])
def test_a_nul_character_in_a_list_filter_or_search_is_refused_not_a_500(name):
    client = client_for(make_user("root", superuser=True))
    url = reverse(f"admin:k2b_workflows_{name}_changelist")
    for query in ("q=a%00b", "status=%00", "app_id=%00", "kind=%00"):
        response = client.get(f"{url}?{query}", follow=True)
        assert response.status_code == 200, query
        assert any("NUL character" in m for m in messages_of(response)), query


# -- hostile form input (#11) ----------------------------------------------------------


HOSTILE_OUTPUTS = {
    "nested 100,000 deep": "[" * 100_000 + "]" * 100_000,
    "nested 100 deep": "[" * 100 + "]" * 100,
    "NUL in a string": '{"charge_id": "ch_\\u0000"}',
    "NUL in a key": '{"a\\u0000": 1}',
    "over a million characters": json.dumps({"blob": "x" * 1_000_001}),
    "a 5000-digit number": '{"amount": ' + "9" * 5000 + "}",
}


@pytest.mark.parametrize("output", HOSTILE_OUTPUTS.values(), ids=HOSTILE_OUTPUTS.keys())
def test_hostile_resolution_output_is_a_form_error_and_changes_nothing(operator, output):
    run = make_incident()
    before = snapshot(run)
    data = resolution_data(run, "effect_confirmed", output=output)
    response = confirm(client_for(operator), run, data)
    assert response.status_code == 200
    assert "output" in response.context["form"].errors
    assert snapshot(run) == before


@pytest.mark.parametrize("evidence", ["checked\x00", "x" * 20_001])
def test_hostile_evidence_is_a_form_error_and_changes_nothing(operator, evidence):
    run = make_incident()
    before = snapshot(run)
    response = confirm(
        client_for(operator), run, resolution_data(run, EFFECT_ABSENT, evidence=evidence)
    )
    assert response.status_code == 200
    assert "evidence" in response.context["form"].errors
    assert snapshot(run) == before


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000, '{"a": "\\u0000"}', '{"a": ' + "9" * 5000 + "}"],
    ids=["deep", "nul", "5000 digits"],
)
def test_hostile_dry_run_input_is_a_form_error(text):
    planner = make_user("paula", "view_workflowrun", "dry_run_workflow")
    url = reverse("admin:k2b_workflows_workflowrun_dry_run")
    for field in ("input", "principal"):
        data = {"workflow": "test.charge", "input": "{}", field: text}
        response = client_for(planner).post(url, data)
        assert response.status_code == 200
        assert field in response.context["form"].errors
    assert not WorkflowRun.objects.exists()


# -- bounded pages (#11) ---------------------------------------------------------------


def test_run_page_shows_the_newest_ledger_entries_and_links_to_the_rest(settings, operator):
    settings.K2B_WORKFLOWS = {**settings.K2B_WORKFLOWS, "ADMIN_RUN_PAGE_ROWS": 1}
    run = make_incident()
    total = LedgerEntry.objects.filter(run=run).count()
    assert total > 1
    response = client_for(operator).get(run_url(run))
    assert [e.pk for e in response.context["ledger"]] == [head_ledger_id(run)]
    html = unescape(response.content.decode())
    assert f"The newest 1 of {total} entries" in html
    assert f"{reverse('admin:k2b_workflows_ledgerentry_changelist')}?q={run.pk}" in html


def test_run_page_shows_a_huge_input_cut_and_redacted(operator):
    run = start_workflow_run(
        "test.pure", {"blob": "x" * 1_000_000, "password": "hunter2", "a": 1, "b": 2}
    )
    response = client_for(operator).get(run_url(run))
    assert response.status_code == 200
    html = unescape(response.content.decode())
    assert len(html) < 100_000
    assert "more characters]" in html
    assert "hunter2" not in html


def test_runs_list_never_reads_inputs_outputs_or_principals(operator):
    big = {"blob": "x" * 1_000_000}
    for i in range(10):
        start_workflow_run("test.pure", {**big, "a": i, "b": 1}, principal={"user": i})
    with CaptureQueriesContext(connection) as queries:
        response = client_for(operator).get(reverse("admin:k2b_workflows_workflowrun_changelist"))
    assert response.status_code == 200
    assert len(response.content) < 200_000
    run_queries = [q["sql"] for q in queries if 'FROM "k2b_run"' in q["sql"]]
    assert run_queries
    for sql in run_queries:
        for column in ("input", "output", "principal"):
            assert f'"k2b_run"."{column}"' not in sql, sql[:300]


#: The incident queue's one read of an input: bounded by its stored size, then its length.
BOUNDED_INPUT_SQL = (
    f'CASE WHEN pg_column_size("k2b_run"."input") > {INPUT_SHOWN_BYTES} THEN NULL'
    f' WHEN octet_length("k2b_run"."input"::text) > {INPUT_SHOWN_CHARS} THEN NULL'
    ' ELSE "k2b_run"."input" END'
)


def test_journal_ledger_and_incident_lists_never_read_the_runs_json_bodies(operator):
    """The incident queue shows a call's arguments (#51), but only an input stored in a
    few kilobytes: the bound is asked of the stored value's header, never the value."""
    start_workflow_run("test.pure", {"blob": "x" * 1_000_000, "a": 1, "b": 2})
    run_until_idle()
    make_incident()
    big = start_workflow_run(
        "test.charge_blind", {"behaviour": "ambiguous", "blob": "x" * 1_000_000}
    )
    run_until_idle()
    client = client_for(make_user("root", superuser=True))
    for name in ("journalentry", "ledgerentry", "incident", "workflowrun"):
        with CaptureQueriesContext(connection) as queries:
            response = client.get(reverse(f"admin:k2b_workflows_{name}_changelist"))
        assert response.status_code == 200
        for sql in (q["sql"] for q in queries):
            sql = sql.replace(BOUNDED_INPUT_SQL, "")
            for column in ("input", "output", "principal"):
                assert f'"k2b_run"."{column}"' not in sql, (name, sql[:300])
        if name == "incident":
            html = response.content.decode()
            assert "ambiguous" in html  # the small incident's arguments
            assert "too large for a list" in html and "x" * 1000 not in html
            assert str(big.pk)[:8] in html


# -- permissions (#11) -----------------------------------------------------------------


def test_cancel_needs_view_permission_too():
    blind = make_user("carl", "cancel_workflowrun")
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    before = snapshot(run)
    url = reverse("admin:k2b_workflows_workflowrun_cancel", args=[run.pk])
    client = client_for(blind)
    assert client.get(url).status_code == 403
    assert client.post(url, {"post": "yes", "reason": "because"}).status_code == 403
    assert snapshot(run) == before
