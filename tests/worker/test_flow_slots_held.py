"""A slot is held until the action has left ``run()`` (#35).

An operator's cancel, a workflow's timeout and ``cancel_in_progress`` end a
run while its worker may be inside ``run()``: freed at that moment, the slot
of a limit-1 key let the next run into the provider beside the canceled one.
Here real worker processes run an action that sleeps inside ``run()``;
overlap is read from the rows the action itself commits as it starts and
ends (``tests/workflows_flow.py``), never from the kernel's bookkeeping.

And ``cancel_in_progress`` never cancels a holder that needs an operator: its
effect is unknown, so the incident stays in the operators' queue and the new
run waits behind the key until it is resolved.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission, User

from k2b_workflows import EFFECT_CONFIRMED, resolve_effect, start_workflow_run
from k2b_workflows.control import cancel_run
from k2b_workflows.models import WorkflowRun
from tests.models import ProviderCall
from tests.support.kernel import execute_exactly, fresh, most_inside, span_edges
from tests.support.processes import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 120  # a shared machine: waits on conditions, never on the clock

NAP = 3.0  # how long the first action stays inside run() after it is canceled


@pytest.mark.parametrize(
    ("name", "how"),
    [
        ("flow.one_at_a_time", "operator"),
        ("flow.one_at_a_time_timed", "timeout"),
        ("flow.latest_wins", "cancel_in_progress"),
    ],
)
def test_a_canceled_action_keeps_its_slot_until_it_has_left_run(start_worker, name, how):
    key = f"held-{how}"
    # The timed workflow is canceled 8 s after its start: its action sleeps 3 s past
    # that, and the second run (started at the cancel) has 8 s of its own to run.
    nap = 11.0 if how == "timeout" else NAP
    first = start_workflow_run(name, {"key": key, "nap": nap}, concurrency_key=key)
    worker = start_worker("--concurrency", "4")
    wait_for(
        lambda: "start" in span_edges(key),
        timeout=TIMEOUT,
        message=worker.report,
    )
    if how == "operator":
        # Ended at once under its action: a cancel_workflow_run of a running run only
        # asks it (#49), and it would keep its slot by running on.
        cancel_run(first.pk, "not needed any more")
    elif how == "cancel_in_progress":
        second = start_workflow_run(name, {"key": key, "nap": 0}, concurrency_key=key)
    wait_for(lambda: fresh(first).status == "canceled", timeout=TIMEOUT, message=worker.report)
    if how != "cancel_in_progress":
        # Started once the first is canceled, its action still inside run().
        second = start_workflow_run(name, {"key": key, "nap": 0}, concurrency_key=key)
    wait_for(
        lambda: fresh(second).status in ("succeeded", "failed", "canceled"),
        timeout=TIMEOUT,
        message=worker.report,
    )
    assert (fresh(second).status, fresh(first).status) == ("succeeded", "canceled")
    order = span_edges(key)
    assert order == ["start", "end", "start", "end"], order
    assert most_inside(key) == 1
    assert not fresh(first).holds_slot and not fresh(second).holds_slot


def test_cancel_in_progress_leaves_a_holder_that_needs_an_operator_in_the_queue():
    first = start_workflow_run("flow.latest_wins_blind", {}, concurrency_key="incident")
    assert execute_exactly(first.pk) == "needs_attention"
    second = start_workflow_run("flow.latest_wins_blind", {}, concurrency_key="incident")
    # The incident stays the operators' and keeps its slot; the new run waits behind it.
    assert fresh(first).status == "needs_attention" and fresh(first).holds_slot
    assert second.status == "queued" and not second.holds_slot
    assert ProviderCall.objects.filter(action="kernel.blind_once").count() == 1
    operator = User.objects.create_user("op", password="x")
    operator.user_permissions.add(Permission.objects.get(codename="resolve_effect"))
    resolve_effect(
        first.pk,
        EFFECT_CONFIRMED,
        evidence="the provider's dashboard shows it",
        actor=User.objects.get(pk=operator.pk),
        output={"sent": "by hand"},
    )
    assert execute_exactly(first.pk) == "succeeded"
    assert fresh(second).holds_slot
    assert WorkflowRun.objects.filter(pk=second.pk, status="queued").exists()
