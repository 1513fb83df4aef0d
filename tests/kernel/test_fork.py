"""Forks: a new run that keeps an ended run's journal before a step and runs on from there.

Each promise of ``fork_workflow_run`` (DESIGN.md, "Fork"), and the bugs of a
peer's reset and replay it must not repeat: completed children run again, a
failure replayed as a success, a task's input duplicated.
"""

from __future__ import annotations

import pytest

from k2b_workflows import ForkRefused, InvalidInput, cancel_workflow_run, start_workflow_run
from k2b_workflows.control import fork_workflow_run
from k2b_workflows.kernel import evidence, seals
from k2b_workflows.models import JournalEntry, LedgerEntry, WorkflowRun
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall
from tests.support.admin import user_with
from tests.workflows import forks as wf

pytestmark = pytest.mark.django_db(transaction=True)

APPS = ["forks"]


@pytest.fixture(autouse=True)
def broken():
    """Today's code has the bug; a test "deploys the fix" by turning it off."""
    wf.BROKEN["on"] = True
    yield wf.BROKEN
    wf.BROKEN["on"] = True


def ended(name: str, input: dict) -> WorkflowRun:
    run = start_workflow_run(name, input)
    run_until_idle(app_ids=APPS)
    run.refresh_from_db()
    return run


def calls(action: str) -> list[ProviderCall]:
    return list(ProviderCall.objects.filter(action=action).order_by("id"))


def fork(run: WorkflowRun, from_step, **kwargs) -> WorkflowRun:
    kwargs.setdefault("actor", "ops@example.com")
    kwargs.setdefault("reason", "the bug is fixed")
    return fork_workflow_run(run.pk, from_step=from_step, **kwargs)


def finish(run: WorkflowRun) -> WorkflowRun:
    run_until_idle(app_ids=APPS)
    run.refresh_from_db()
    return run


def forked_entry(run: WorkflowRun) -> LedgerEntry:
    return LedgerEntry.objects.get(run=run, kind="forked")


# -- keeps the steps before the fork point, runs the rest on today's code -------------


def test_a_fork_keeps_earlier_results_and_runs_the_later_steps_on_todays_code(broken):
    original = ended("forks.line", {"to": "a@example.com"})
    assert (original.status, original.error_code) == ("failed", "BROKEN")
    broken["on"] = False

    forked = finish(fork(original, 2))

    assert forked.status == "succeeded"
    # The steps before the fork point were not called again: their results were kept.
    assert len(calls("forks.note")) == 1 and len(calls("forks.send")) == 1
    assert len(calls("forks.brittle")) == 2
    assert forked.output == {"sent": f"{original.pk}:1"}
    kept = JournalEntry.objects.filter(run=forked).order_by("seq")
    assert [(e.seq, e.action_name) for e in kept] == [
        (0, "forks.note"),
        (1, "forks.send"),
        (2, "forks.brittle"),
    ]
    # The original is as it was.
    original.refresh_from_db()
    assert (original.status, original.error_code) == ("failed", "BROKEN")


def test_a_fork_is_linked_both_ways_and_verifies_as_any_run():
    original = ended("forks.line", {"to": "a@example.com"})
    forked = fork(original, 1)
    assert forked.forked_from_id == original.pk
    assert list(original.forks.all()) == [forked]
    assert seals.start_problem(forked) is None
    assert evidence.verify_chains(forked.pk, "default") is None
    assert evidence.verify_chains(original.pk, "default") is None
    assert forked_entry(original).detail["fork"] == str(forked.pk)
    # The copied entries are the kernel's own, chained for the new run.
    assert [e.run_id for e in JournalEntry.objects.filter(run=forked)] == [forked.pk]
    # A forged link is the start seal's business.
    WorkflowRun.objects.filter(pk=forked.pk).update(forked_from=None)
    forked.refresh_from_db()
    assert seals.start_problem(forked) is not None


def test_fork_from_failure_runs_the_failed_step_again(broken):
    original = ended("forks.line", {"to": "a@example.com"})
    broken["on"] = False
    forked = finish(fork(original, "failure"))
    assert forked.status == "succeeded"
    assert forked_entry(forked).detail["from_step"] == 2
    assert len(calls("forks.send")) == 1


def test_a_failure_before_the_fork_point_stays_a_failure(broken):
    original = ended("forks.catching", {})
    assert original.status == "failed"
    broken["on"] = False  # today's code would succeed at step 0: the fork must not ask it

    forked = finish(fork(original, "failure"))

    assert forked_entry(forked).detail["from_step"] == 2
    assert forked.status == "succeeded"
    assert forked.output == {"first": "failed"}
    assert [c.payload["n"] for c in calls("forks.brittle")] == [0, 2, 2]


# -- effects that may have happened ---------------------------------------------------


@pytest.mark.parametrize(
    ("behaviour", "state"),
    [("", "confirmed"), ("decline", "dispatched"), ("raise", "unknown")],
)
def test_an_external_step_after_the_fork_point_refuses_the_fork(behaviour, state):
    original = ended("forks.line", {"to": "a@example.com", "pay": True, "behaviour": behaviour})
    if original.status == "needs_attention":
        cancel_workflow_run(original.pk, "settled with the provider")
    runs = WorkflowRun.objects.count()

    with pytest.raises(ForkRefused) as refused:
        fork(original, 1)

    assert refused.value.steps == [
        {"seq": 2, "action": "forks.pay", "effect": "external", "state": state}
    ]
    assert "step 2 (forks.pay, external" in str(refused.value)
    assert WorkflowRun.objects.count() == runs
    assert not LedgerEntry.objects.filter(kind="forked").exists()


def test_naming_the_external_step_repeats_it_and_the_evidence_says_who_and_why(broken):
    original = ended("forks.line", {"to": "a@example.com", "pay": True})
    broken["on"] = False

    forked = finish(
        fork(original, 1, repeat_effects=[2], actor="alice", reason="refunded, charge again")
    )

    assert forked.status == "succeeded"
    assert len(calls("forks.pay")) == 2
    entry = forked_entry(forked)
    assert (entry.actor, entry.message) == ("alice", "refunded, charge again")
    assert entry.detail["repeat_effects"] == [2]
    assert entry.detail["repeated"] == [
        {"seq": 2, "action": "forks.pay", "effect": "external", "state": "confirmed"}
    ]
    # A repeated external effect is a new call: new keys.
    first, second = calls("forks.pay")
    assert first.effect_key == f"{original.pk}:2" and second.effect_key == f"{forked.pk}:2"


def test_a_fork_from_after_the_external_step_is_not_refused(broken):
    original = ended("forks.line", {"to": "a@example.com", "pay": True})
    broken["on"] = False
    forked = finish(fork(original, "failure"))
    assert forked.status == "succeeded"
    assert len(calls("forks.pay")) == 1


def test_an_idempotent_step_runs_again_with_the_originals_effect_key(broken):
    original = ended("forks.line", {"to": "a@example.com"})
    broken["on"] = False
    forked = finish(fork(original, 1))
    assert [c.effect_key for c in calls("forks.send")] == [f"{original.pk}:1"] * 2
    assert forked.output == {"sent": f"{original.pk}:1"}
    # A fork of the fork keeps the first key still.
    again = finish(fork(forked, 1))
    assert again.output == {"sent": f"{original.pk}:1"}


def test_an_idempotent_step_named_in_repeat_effects_gets_a_new_key(broken):
    original = ended("forks.line", {"to": "a@example.com"})
    broken["on"] = False
    forked = finish(fork(original, 1, repeat_effects=[1]))
    assert [c.effect_key for c in calls("forks.send")] == [f"{original.pk}:1", f"{forked.pk}:1"]


# -- children and task calls ------------------------------------------------------------


def test_children_of_steps_before_the_fork_point_are_kept(broken):
    original = ended("forks.parent", {})
    assert original.status == "failed"
    assert original.children.count() == 2
    broken["on"] = False

    forked = finish(fork(original, "failure"))

    assert forked.status == "succeeded"
    assert forked.output == {"kids": [{"n": 1}, {"n": 2}]}
    assert forked.children.count() == 0  # replayed from the journal, never created again
    assert len(calls("forks.note")) == 2
    assert WorkflowRun.objects.filter(workflow_name="forks.kid").count() == 2


def test_a_children_step_whose_children_paid_refuses_the_fork():
    original = ended("forks.parent", {"kid": "forks.paying_kid"})
    with pytest.raises(ForkRefused) as refused:
        fork(original, 0)
    (step,) = refused.value.steps
    assert (step["seq"], step["effect"], len(step["children"])) == (0, "children", 2)


def test_a_fork_of_a_task_call_is_a_new_call_with_the_same_arguments():
    from tests.tasks_app import tasks as t

    result = t.boom.enqueue("went wrong")
    run_until_idle()
    original = WorkflowRun.objects.get(pk=result.id)
    assert original.status == "failed"

    forked = fork(original, "failure")

    assert forked.pk != original.pk
    assert forked.input == original.input  # once, as it was: not duplicated
    assert (forked.task_path, forked.queue) == (original.task_path, original.queue)
    run_until_idle()
    assert ProviderCall.objects.filter(action="task.boom").count() == 2


def test_a_fork_of_an_external_task_call_that_ran_is_refused():
    from tests.tasks_app import tasks as t

    result = t.charge.enqueue(7)
    run_until_idle()
    with pytest.raises(ForkRefused):
        fork(WorkflowRun.objects.get(pk=result.id), 0)


# -- bad input -----------------------------------------------------------------------------


def test_an_unknown_run_is_a_clear_error():
    with pytest.raises(WorkflowRun.DoesNotExist):
        fork_workflow_run(
            "00000000-0000-0000-0000-000000000000", from_step=0, actor="a", reason="r"
        )


@pytest.mark.parametrize("step", [-1, 4, "2", True, None, "first"])
def test_a_from_step_that_is_no_step_of_the_run_is_refused(step):
    original = ended("forks.line", {"to": "a@example.com"})
    with pytest.raises(InvalidInput, match="from_step"):
        fork(original, step)
    assert not original.forks.exists()


def test_failure_on_a_run_that_did_not_fail_is_refused(broken):
    broken["on"] = False
    original = ended("forks.line", {"to": "a@example.com"})
    assert original.status == "succeeded"
    with pytest.raises(InvalidInput, match="not failed"):
        fork(original, "failure")
    with pytest.raises(InvalidInput, match="steps are 0 to 2"):
        fork(original, 3)  # a succeeded run has no step it stopped at


def test_a_run_that_may_still_act_is_not_forked():
    queued = start_workflow_run("forks.line", {"to": "a@example.com"})
    with pytest.raises(InvalidInput, match="queued"):
        fork(queued, 0)
    doubted = ended("forks.line", {"to": "a@example.com", "pay": True, "behaviour": "raise"})
    assert doubted.status == "needs_attention"
    with pytest.raises(InvalidInput, match="cancel it first"):
        fork(doubted, 0)


@pytest.mark.parametrize("repeat", [[0], [9], ["2"], "2"])
def test_repeat_effects_naming_steps_not_at_or_after_the_fork_point_is_refused(repeat):
    original = ended("forks.line", {"to": "a@example.com"})
    with pytest.raises(InvalidInput, match="repeat_effects"):
        fork(original, 1, repeat_effects=repeat)
    assert not original.forks.exists()


@pytest.mark.parametrize(
    ("actor", "reason", "match"),
    [("", "why", "actor"), (None, "why", "actor"), ("ops", "", "reason"), ("ops", " ", "reason")],
)
def test_a_fork_needs_an_actor_and_a_reason(actor, reason, match):
    original = ended("forks.line", {"to": "a@example.com"})
    with pytest.raises(InvalidInput, match=match):
        fork(original, 1, actor=actor, reason=reason)


def test_a_user_needs_the_fork_permission():
    from django.core.exceptions import PermissionDenied

    original = ended("forks.line", {"to": "a@example.com"})
    with pytest.raises(PermissionDenied):
        fork(original, 1, actor=user_with("retry_workflowrun", name="retrier"))
    forked = fork(original, 1, actor=user_with("fork_workflowrun"))
    assert forked_entry(forked).actor_id is not None


# -- more of the peers' bugs, and what a fork writes ----------------------------------------


def test_children_of_a_step_at_the_fork_point_are_created_once_for_the_fork(broken):
    original = ended("forks.parent", {})
    broken["on"] = False
    forked = finish(fork(original, 0))
    assert forked.status == "succeeded"
    assert forked.children.count() == 2 and original.children.count() == 2
    assert len(calls("forks.note")) == 4  # the original's two children, then the fork's two


def test_a_fork_that_fails_half_way_writes_nothing(monkeypatch):
    from k2b_workflows.kernel import forks

    original = ended("forks.line", {"to": "a@example.com"})
    runs, entries = WorkflowRun.objects.count(), LedgerEntry.objects.count()
    appended = forks.evidence.append_ledger

    def second_fails(using, **fields):
        if fields["run_id"] == original.pk:
            raise RuntimeError("the database went away")
        return appended(using, **fields)

    monkeypatch.setattr(forks.evidence, "append_ledger", second_fails)
    with pytest.raises(RuntimeError):
        fork(original, 1)
    assert (WorkflowRun.objects.count(), LedgerEntry.objects.count()) == (runs, entries)
    assert JournalEntry.objects.filter(run__forked_from=original).count() == 0


def test_a_kept_key_is_only_for_the_same_action_at_the_same_step():
    from k2b_workflows.kernel.forks import key_for

    kept = {1: ("orig:1", "forks.send"), 2: ("orig:2", "")}
    assert key_for(kept, 1, "forks.send", "own:1") == "orig:1"
    assert key_for(kept, 1, "forks.other", "own:1") == "own:1"  # the new code put another call
    assert key_for(kept, 2, "forks.other", "own:2") == "orig:2"  # the original's action unknown
    assert key_for(kept, 3, "forks.send", "own:3") == "own:3"  # the original never got there


def test_a_fork_runs_on_the_newest_version_or_the_one_asked():
    from k2b_workflows import UnknownWorkflow

    parked = start_workflow_run("ver.checkout", {"key": "never"}, version=1)
    run_until_idle(app_ids=["versions"])
    original = cancel_workflow_run(parked.pk, "the customer left")
    assert fork(original, 1).workflow_version == 2  # today's code
    assert fork(original, 1, version=1).workflow_version == 1
    with pytest.raises(UnknownWorkflow):
        fork(original, 1, version=9)
    assert original.forks.count() == 2


def test_a_forked_task_call_reads_back_as_a_task_result():
    from tests.tasks_app import tasks as t

    result = t.add.enqueue(2, 3)
    run_until_idle()
    forked = fork(WorkflowRun.objects.get(pk=result.id), 0)
    run_until_idle()
    again = t.add.get_result(str(forked.pk))
    assert (again.return_value, again.args) == (5, [2, 3])
