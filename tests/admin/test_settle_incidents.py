"""Several incidents settled by one decision (#51): a selection, one evidence text and one
outcome, a confirmation page listing each run, then each run resolved on its own through
``control.resolve_effect``: its own ledger entry, seal and audit line. Capped; runs not
waiting for a decision are skipped with why; a malformed form resolves nothing."""

from __future__ import annotations

import re

import pytest
from django.contrib.admin.models import LogEntry
from django.urls import reverse

from k2b_workflows import EFFECT_ABSENT, EFFECT_CONFIRMED, resolve_effect, start_workflow_run
from k2b_workflows.admin import settle
from k2b_workflows.kernel import evidence
from k2b_workflows.models import LedgerEntry, WorkflowRun
from k2b_workflows.testing import run_until_idle
from tests.support.admin import client_for, make_incident, make_user

pytestmark = pytest.mark.django_db(transaction=True)

EVIDENCE = "Provider dashboard, 02:10: none of these charges exists."
INCIDENTS = reverse("admin:k2b_workflows_incident_changelist")
RUNS = reverse("admin:k2b_workflows_workflowrun_changelist")


@pytest.fixture
def root():
    return client_for(make_user("root", superuser=True))


@pytest.fixture
def incidents():
    return [make_incident() for _ in range(3)]


def selection(runs, **extra):
    return {
        "action": "settle_incidents",
        "_selected_action": [str(run.pk) for run in runs],
        **extra,
    }


def listed(html: str) -> list[str]:
    """The runs the page says it will settle, in order."""
    rows = re.findall(r'<tr class="k2b-settle-run"><td><a href="[^"]*">([0-9a-f-]{36})</a>', html)
    return rows


def confirm(client, runs, url=INCIDENTS, **fields):
    data = selection(runs, post="form", decision=EFFECT_ABSENT, evidence=EVIDENCE)
    data.update(fields)
    response = client.post(url, data)
    assert response.status_code == 200
    html = response.content.decode()
    assert "Please confirm" in html, html
    return html, re.findall(r'name="seen" value="([^"]+)"', html)


def settled(run) -> bool:
    return LedgerEntry.objects.filter(
        run=run, kind__in=["resolved_absent", "resolved_confirmed"]
    ).exists()


def test_the_form_then_the_confirmation_list_each_run_and_resolve_nothing_yet(root, incidents):
    first = root.post(INCIDENTS, selection(incidents))
    html = first.content.decode()
    assert first.status_code == 200 and 'name="evidence"' in html
    assert sorted(listed(html)) == sorted(str(run.pk) for run in incidents)
    assert f">{settle.MAX_SETTLE}</strong> runs are settled at once" in html

    html, seen = confirm(root, incidents)
    assert sorted(listed(html)) == sorted(str(run.pk) for run in incidents)
    assert len(seen) == 3 and EVIDENCE in html
    assert not any(settled(run) for run in incidents)


def test_confirmed_each_run_is_resolved_sealed_and_audited_on_its_own(root, incidents):
    _, seen = confirm(root, incidents)
    response = root.post(
        INCIDENTS,
        selection(incidents, post="yes", decision=EFFECT_ABSENT, evidence=EVIDENCE, seen=seen),
    )
    assert response.status_code == 302
    for run in incidents:
        (entry,) = LedgerEntry.objects.filter(run=run, kind="resolved_absent")
        assert (entry.actor, entry.evidence, entry.seq) == ("root", EVIDENCE, 0)
        assert WorkflowRun.objects.get(pk=run.pk).status == "queued"
        assert evidence.verify_chains(run.pk, "default") is None  # its own chain, intact
        assert LogEntry.objects.filter(object_id=str(run.pk)).count() == 1


def test_confirmed_with_an_output_each_run_continues_with_it(root, incidents):
    output = '{"charge_id": "ch_dashboard"}'
    _, seen = confirm(root, incidents, decision=EFFECT_CONFIRMED, output=output)
    root.post(
        INCIDENTS,
        selection(
            incidents,
            post="yes",
            decision=EFFECT_CONFIRMED,
            evidence=EVIDENCE,
            output=output,
            seen=seen,
        ),
    )
    run_until_idle()
    for run in incidents:
        assert LedgerEntry.objects.filter(run=run, kind="resolved_confirmed").count() == 1
        assert WorkflowRun.objects.get(pk=run.pk).status == "succeeded"


def test_a_run_not_waiting_for_a_decision_is_skipped_with_why(root, incidents):
    done = start_workflow_run("test.pure", {"a": 1, "b": 2})
    run_until_idle()
    html, seen = confirm(root, [*incidents, done], url=RUNS)
    assert str(done.pk) not in listed(html)
    assert re.search(rf"{done.pk}</a> [^:]*: it is succeeded, not waiting for a decision", html)
    root.post(
        RUNS,
        selection(
            [*incidents, done], post="yes", decision=EFFECT_ABSENT, evidence=EVIDENCE, seen=seen
        ),
    )
    assert all(settled(run) for run in incidents)
    assert not LedgerEntry.objects.filter(run=done).exists()


def resolve_alone(run, operator):
    head = LedgerEntry.objects.filter(run=run).order_by("-id").first()
    resolve_effect(
        run.pk,
        EFFECT_ABSENT,
        evidence="checked alone",
        actor=operator,
        step=0,
        seen_ledger_id=head.pk,
    )


def test_a_run_settled_alone_after_the_confirmation_is_left_alone_and_named(
    root, incidents, operator
):
    _, seen = confirm(root, incidents)
    resolve_alone(incidents[0], operator)  # another operator, meanwhile
    response = root.post(
        INCIDENTS,
        selection(incidents, post="yes", decision=EFFECT_ABSENT, evidence=EVIDENCE, seen=seen),
        follow=True,
    )
    assert LedgerEntry.objects.filter(run=incidents[0], kind="resolved_absent").count() == 1
    assert all(settled(run) for run in incidents[1:])
    assert f"Run {incidents[0].pk}: no longer waiting" in response.content.decode()


def test_a_run_whose_evidence_changed_after_the_confirmation_is_refused_alone(
    root, incidents, operator
):
    """Its step ran again and is in doubt again: what the operator confirmed was the
    evidence of the earlier call, so that run is refused; the others are settled."""
    _, seen = confirm(root, incidents)
    first = incidents[0]
    resolve_alone(first, operator)
    run_until_idle()
    assert WorkflowRun.objects.get(pk=first.pk).status == "needs_attention"
    response = root.post(
        INCIDENTS,
        selection(incidents, post="yes", decision=EFFECT_ABSENT, evidence=EVIDENCE, seen=seen),
        follow=True,
    )
    assert LedgerEntry.objects.filter(run=first, kind="resolved_absent").count() == 1
    assert all(settled(run) for run in incidents[1:])
    assert f"Run {first.pk}: new evidence arrived" in response.content.decode()


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"evidence": "   "}, "This field is required"),
        ({"decision": "maybe"}, "Select a valid choice"),
        ({"decision": EFFECT_CONFIRMED, "output": "{not json"}, "not valid JSON"),
        ({"decision": EFFECT_CONFIRMED, "output": ""}, "needs the steps&#x27; output"),
        ({"seen": ["nonsense"]}, "expected RUN_ID:STEP:LEDGER_ID"),
        ({"seen": []}, "does not say which step and evidence"),
    ],
)
def test_a_malformed_confirmation_resolves_nothing_and_says_why(root, incidents, fields, said):
    _, seen = confirm(root, incidents)
    data = selection(incidents, post="yes", decision=EFFECT_ABSENT, evidence=EVIDENCE, seen=seen)
    data.update(fields)
    response = root.post(INCIDENTS, data)
    assert response.status_code == 200
    assert said in response.content.decode()
    assert not any(settled(run) for run in incidents)


def test_a_token_for_a_run_not_selected_resolves_nothing(root, incidents):
    _, seen = confirm(root, incidents[:2])
    other = [t for t in confirm(root, incidents)[1] if t not in seen]
    response = root.post(
        INCIDENTS,
        selection(
            incidents[:2],
            post="yes",
            decision=EFFECT_ABSENT,
            evidence=EVIDENCE,
            seen=[*seen, *other],
        ),
    )
    assert "which is not selected" in response.content.decode()
    assert not any(settled(run) for run in incidents)


def test_a_selection_above_the_cap_resolves_nothing(root, incidents, monkeypatch):
    monkeypatch.setattr(settle, "MAX_SETTLE", 2)
    html = root.post(INCIDENTS, selection(incidents)).content.decode()
    assert "3 runs are selected; at most 2 are settled at once" in html
    assert 'name="evidence"' not in html
    seen = [f"{run.pk}:0:0" for run in incidents]
    response = root.post(
        INCIDENTS,
        selection(incidents, post="yes", decision=EFFECT_ABSENT, evidence=EVIDENCE, seen=seen),
    )
    assert "at most 2 are settled at once" in response.content.decode()
    assert not any(settled(run) for run in incidents)


def test_an_operator_without_the_resolve_permission_settles_nothing(incidents):
    viewer = client_for(make_user("vera", "view_workflowrun"))
    response = viewer.post(
        INCIDENTS,
        selection(
            incidents,
            post="yes",
            decision=EFFECT_ABSENT,
            evidence=EVIDENCE,
            seen=[f"{run.pk}:0:0" for run in incidents],
        ),
    )
    assert response.status_code in (200, 302, 403)
    assert 'name="evidence"' not in response.content.decode()
    assert not any(settled(run) for run in incidents)


def test_the_list_shows_each_calls_arguments_but_never_a_large_input(root):
    small = make_incident()
    big = start_workflow_run("test.charge_blind", {"behaviour": "ambiguous", "blob": "x" * 10**6})
    run_until_idle()
    html = root.post(INCIDENTS, selection([small, big])).content.decode()
    assert sorted(listed(html)) == sorted([str(small.pk), str(big.pk)])
    assert "ambiguous" in html
    assert "too large for a list: see the run" in html and "x" * 1000 not in html
