"""Provider polling: a pending EXTERNAL effect is asked again, never dispatched again."""

from __future__ import annotations

import pytest

from k2b_workflows import start_workflow_run, wake_workflow_runs_waiting_on
from k2b_workflows.models import JournalEntry, LedgerEntry, WorkflowRun
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall

pytestmark = pytest.mark.django_db(transaction=True)


def test_pending_effect_is_polled_at_each_deadline_without_a_second_dispatch():
    run = start_workflow_run("test.payout", {"polls": 3, "every_ms": 30})

    run_until_idle(wait_for_deadlines=True, timeout=30)

    run.refresh_from_db()
    assert run.status == "succeeded", (run.error_code, run.error_message)
    assert run.output == {"settled": True, "polls": 3}
    assert ProviderCall.objects.filter(action="payout.submit").count() == 1
    polls = list(ProviderCall.objects.filter(action="payout.poll").order_by("id"))
    assert len(polls) == 3
    assert {p.effect_key for p in polls} == {f"{run.pk}:0"}
    # Each poll is its own execution: a new generation, the same invocation.
    assert [p.generation for p in polls] == sorted({p.generation for p in polls})
    assert {p.invocation_key for p in polls} == {f"{run.pk}:0:1"}
    pending = LedgerEntry.objects.filter(run=run, kind=LedgerEntry.Kind.PENDING)
    assert pending.count() == 2
    kinds = list(LedgerEntry.objects.filter(run=run).order_by("id").values_list("kind", flat=True))
    assert kinds.count("dispatched") == 1
    assert kinds[-1] == "reconciled"
    assert JournalEntry.objects.filter(run=run).count() == 1


def test_pending_effect_is_polled_early_when_the_provider_calls_back():
    run = start_workflow_run("test.payout", {"polls": 2, "every_ms": 3_600_000})
    run_until_idle()
    run.refresh_from_db()
    assert run.status == "waiting"
    assert (run.wait_kind, run.wait_key) == ("payout", f"{run.pk}:0")

    # The provider's webhook: no need to wait an hour for the deadline.
    assert wake_workflow_runs_waiting_on(app_id="tests", kind="payout", key=f"{run.pk}:0") == 1
    run_until_idle()

    run.refresh_from_db()
    assert run.status == "succeeded"
    assert ProviderCall.objects.filter(action="payout.submit").count() == 1
    assert WorkflowRun.objects.get(pk=run.pk).output == {"settled": True, "polls": 2}
