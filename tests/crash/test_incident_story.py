"""An incident says what happened in words (#51), read from the rows a real crash left.

A worker is killed (SIGKILL) inside an external call; another takes the run over
and, with no reconcile to ask, stops it for an operator. ``incidents.what_happened``
then names the worker that held the call (its host and pid), says that it died,
when the run was taken over and by which worker, at which step, and what was
answered since; the admin's incident box and ``manage.py workflowrun show`` say
the same sentences. The same rows, changed one fact at a time, show that each
claim rests on a row: where the row is missing the sentence says "unknown".
"""

from __future__ import annotations

import copy
import datetime as dt
import io
import json

import pytest
from django.core.management import call_command
from django.urls import reverse

from k2b_workflows import incidents, start_workflow_run
from k2b_workflows.models import LedgerEntry, WorkerRecord, WorkflowRun
from k2b_workflows.store import EFFECT_OUTCOME_UNKNOWN
from tests.crash.test_crash import crashing_worker, healthy_worker, killed, settled
from tests.support.kernel import fresh
from tests.tasks_app import tasks as t

pytestmark = [pytest.mark.crash, pytest.mark.django_db(transaction=True)]


def killed_mid_call(start_worker, wait, run, point):
    """SIGKILL the first worker after the provider's call; a second settles the run."""
    first = crashing_worker(start_worker, point)
    killed(first)
    second = healthy_worker(start_worker)
    settled(wait, run, second)
    done = fresh(run)
    assert (done.status, done.error_code) == ("needs_attention", EFFECT_OUTCOME_UNKNOWN)
    return done, first, second


def rows(run):
    ledger = list(LedgerEntry.objects.filter(run=run, seq=run.attention_step).order_by("id"))
    workers = {w.worker_id: w for w in WorkerRecord.objects.all()}
    return ledger, workers


def test_a_worker_killed_inside_an_external_call_is_named_and_said_to_have_died(start_worker, wait):
    run = start_workflow_run("test.charge_blind", {"amount": 9, "crash": "external_after_effect"})
    done, first, second = killed_mid_call(start_worker, wait, run, "external_after_effect")
    (holder,) = done.lease_lost_by

    story = incidents.story_of(done)
    assert story[0].startswith("At ") and f"worker {holder} (host " in story[0]
    assert f"pid {first.pid})" in story[0]
    assert "step 0 (action test.charge_blind), under fence 1" in story[0]
    assert f"taken over by worker {done.claimed_by} (host " in story[1]
    assert f"pid {second.pid}), under fence 2" in story[1]
    assert story[2].startswith("It died: its process is gone"), story
    assert "the action has no reconcile()" in story[3]

    # Each claim rests on a row: change one and the sentence changes with it.
    ledger, workers = rows(done)
    alive = dict.fromkeys(workers, True)
    assert incidents.what_happened(done, ledger, workers, alive)[2].startswith("It is frozen")
    came_back = copy.copy(workers[holder])
    came_back.heartbeat_at = ledger[-1].created_at + dt.timedelta(seconds=1)
    beaten = incidents.what_happened(done, ledger, {**workers, holder: came_back}, {})
    assert beaten[2].startswith("It had not died: it beat again")
    gone = incidents.what_happened(done, ledger, {}, {})
    assert "host and pid unknown: its row is gone" in gone[0]
    assert "Whether it died or froze is unknown" in gone[2]
    kept = copy.copy(done)
    kept.lease_lost_by = None  # no record that the holder lost its lease
    said = incidents.what_happened(kept, ledger, workers, {})
    assert "whether the worker of the call lost its lease is unknown" in said[1]
    assert not any(sentence.startswith("It died") for sentence in said)
    unnamed = [copy.copy(e) for e in ledger]
    unnamed[0].detail = None
    said = incidents.what_happened(done, unnamed, workers, {})
    assert "a worker the rows do not name (unknown)" in said[0]
    assert "whether the worker of the call lost its lease is unknown" in said[1]


def test_a_keyless_task_killed_mid_call_is_named_by_its_path_and_shows_no_effect_key(
    start_worker, wait, admin_client
):
    result = t.charge_keyless.enqueue("o-7", crash="task_external")
    run = WorkflowRun.objects.get(pk=result.id)
    done, first, _ = killed_mid_call(start_worker, wait, run, "task_external")

    story = incidents.story_of(done)
    assert "step 0 (task tests.tasks_app.tasks.charge_keyless)" in story[0]
    assert f"pid {first.pid})" in story[0]
    assert story[2].startswith("It died")

    # The CLI says the same sentences as the admin.
    out = io.StringIO()
    call_command("workflowrun", "show", str(done.pk), stdout=out)
    assert "what happened:" in out.getvalue()
    assert all(sentence in out.getvalue() for sentence in story)
    out = io.StringIO()
    call_command("workflowrun", "show", str(done.pk), "--json", stdout=out)
    assert json.loads(out.getvalue())["run"]["what_happened"] == story

    page = admin_client.get(reverse("admin:k2b_workflows_workflowrun_change", args=[done.pk]))
    html = page.content.decode()
    assert "What happened" in html and f"pid {first.pid})" in html
    form = admin_client.get(reverse("admin:k2b_workflows_incident_resolve", args=[done.pk]))
    html = form.content.decode()
    assert "o-7" in html  # the call's arguments
    dispatch = LedgerEntry.objects.get(run=done, kind="dispatched")
    assert f"<code>{dispatch.effect_key}</code>" not in html
    assert "what the provider knows this effect by" not in html
    assert "this task takes no context" in html
