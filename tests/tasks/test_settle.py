"""Tasks that settle their own crashes (#51): a ``reconcile`` answers what an external
call's crash left unknown, ``Retry(on=...)`` retries only the exceptions it names, and
``OPTIONS["tasks"]`` gives both (and an effect) to tasks one does not own.

The crash tests kill a real ``runworkflows`` with SIGKILL before or after the
provider's call; the lookup (``tests.tasks_app.tasks.was_charged``) reads the
provider's log by the call's effect key, as a provider's API would.
"""

from __future__ import annotations

import signal

import pytest
from django.core.exceptions import ImproperlyConfigured

from k2b_workflows.checks import check_task_overrides
from k2b_workflows.models import LedgerEntry, WorkflowRun
from k2b_workflows.tasks import InvalidTaskCall, WorkflowsBackend
from k2b_workflows.tasks.options import TaskOptions, TaskOverride
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall
from tests.tasks_app import library
from tests.tasks_app import tasks as t
from tests.tasks_app.tasks import EXTRA_ARGUMENTS

try:
    from django.tasks import TaskResultStatus, task
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskResultStatus, task  # type: ignore[no-redef]

TIMEOUT = 90  # generous: the machine is shared; nothing here is a timing assertion
SUCCESSFUL, FAILED = TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED


def calls(action: str) -> list[ProviderCall]:
    return list(ProviderCall.objects.filter(action=action).order_by("id"))


def settle(wait, result_id, worker, statuses=("succeeded", "failed", "needs_attention")):
    wait(
        lambda: WorkflowRun.objects.get(pk=result_id).status in statuses,
        timeout=TIMEOUT,
        message=lambda: f"task {result_id} to settle:\n{worker.report()}",
    )
    return WorkflowRun.objects.get(pk=result_id)


def crash_then_heal(start_worker, wait, result, point):
    """SIGKILL the first worker at ``point``; a healthy one settles the call."""
    killer = start_worker("--concurrency", "1", env={"K2B_TEST_CRASH": point})
    code = killer.wait(timeout=TIMEOUT)
    assert code == -signal.SIGKILL, f"worker exited {code}:\n{killer.output()}"
    healthy = start_worker("--concurrency", "1")
    return settle(wait, result.id, healthy), healthy


def ledger(run_id) -> list[str]:
    return list(
        LedgerEntry.objects.filter(run_id=run_id).order_by("id").values_list("kind", flat=True)
    )


# -- a reconcile settles the call --------------------------------------------------------


@pytest.mark.crash
@pytest.mark.django_db(transaction=True)
def test_an_external_task_killed_after_its_charge_is_settled_by_its_reconcile(start_worker, wait):
    """The kept-back case: killed mid-call, it ends SUCCESSFUL with no incident, one charge,
    and the value its reconcile found."""
    result = t.charge_reconciled.enqueue("o-1", crash="task_reconciled_after")
    run, _ = crash_then_heal(start_worker, wait, result, "task_reconciled_after")
    assert run.status == "succeeded", run.error_message
    charges = calls("task.charge_reconciled")
    assert len(charges) == 1
    assert [c.effect_key for c in calls("task.was_charged")] == [charges[0].effect_key]
    settled = t.charge_reconciled.get_result(result.id)
    assert settled.status == SUCCESSFUL
    assert settled.return_value == {"charged": "o-1", "found": True}
    assert settled.attempts == 1  # one call of the function, settled without another
    assert "reconciled" in ledger(result.id)


@pytest.mark.crash
@pytest.mark.django_db(transaction=True)
def test_a_call_its_reconcile_finds_absent_is_made_again_once(start_worker, wait):
    """Killed after its dispatch committed but before the provider was called: the
    reconcile says "no charge under this key" (``failed(retryable=True)``), so the call is
    made again as a new attempt, under the same effect key: one charge in all."""
    result = t.charge_reconciled.enqueue("o-2", crash="task_reconciled_before")
    run, _ = crash_then_heal(start_worker, wait, result, "task_reconciled_before")
    assert run.status == "succeeded", run.error_message
    charges = calls("task.charge_reconciled")
    assert len(charges) == 1
    assert charges[0].effect_key == calls("task.was_charged")[0].effect_key
    settled = t.charge_reconciled.get_result(result.id)
    assert settled.return_value == {"charged": "o-2"}
    # Two calls of the function (the first cut before the provider): both counted,
    # each named by its worker, the killed one first.
    assert settled.attempts == 2
    assert settled.worker_ids[0] != settled.worker_ids[1]
    assert all(settled.worker_ids)


@pytest.mark.crash
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("answer", "status", "said"),
    [
        ("unknown", "needs_attention", "the provider's lookup is down"),
        ("raise", "needs_attention", "RuntimeError: lookup failed"),
        ("nonsense", "needs_attention", "a task's reconcile returns"),
        ("declined", "failed", "the provider declined it"),
    ],
)
def test_what_a_reconcile_cannot_settle_goes_to_an_operator_and_a_no_fails_the_call(
    start_worker, wait, answer, status, said
):
    result = t.charge_reconciled.enqueue("o-3", crash="task_reconciled_after", answer=answer)
    run, _ = crash_then_heal(start_worker, wait, result, "task_reconciled_after")
    assert run.status == status, run.error_message
    assert said in run.error_message
    assert len(calls("task.charge_reconciled")) == 1  # never called again


# -- Retry(on=...) -----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("raised", "attempts", "status"), [("ConnectionError", 3, SUCCESSFUL), ("Declined", 1, FAILED)]
)
def test_a_task_is_retried_only_for_the_exceptions_its_retry_names(raised, attempts, status):
    result = t.picky.enqueue("k", raised)
    run_until_idle()
    assert len(calls("task.picky")) == attempts
    settled = t.picky.get_result(result.id)
    assert settled.status == status
    if status == FAILED:
        assert settled.errors[0].exception_class_path == "tests.tasks_app.tasks.Declined"


# -- options from settings ---------------------------------------------------------------


def options(task_) -> TaskOptions:
    return task_.get_backend().options_of(task_)


def test_settings_give_options_to_tasks_one_does_not_own_and_the_most_specific_wins():
    assert options(library.reindex).effect == "idempotent"  # "tests.tasks_app.library.*"
    assert options(library.purge).effect == "pure"  # its own path, more specific
    reconciled = options(t.charge_reconciled)
    assert reconciled.effect == "external"  # the alias's default: settings gave only a reconcile
    assert reconciled.reconcile == "tests.tasks_app.tasks.was_charged"
    assert reconciled.to_input()["reconcile"] == "tests.tasks_app.tasks.was_charged"
    assert "reconcile" not in options(t.charge).to_input()  # no key where none is declared
    assert options(t.picky).retry.on == ("builtins.ConnectionError",)
    assert "on" not in options(t.flaky).to_input()["retry"]


@pytest.mark.skipif(not EXTRA_ARGUMENTS, reason="@task takes no effect= on Django 6.0")
def test_a_tasks_own_declaration_wins_over_settings():
    assert options(library.sends).effect == "external"


@pytest.mark.skipif(not EXTRA_ARGUMENTS, reason="@task takes no reconcile= on Django 6.0")
def test_a_task_declares_its_reconcile_as_a_module_level_function():
    made = task(effect="external", reconcile=t.was_charged)(t.charge_reconciled.func)
    assert options(made).reconcile == "tests.tasks_app.tasks.was_charged"
    with pytest.raises(InvalidTaskCall, match="reconcile applies to an external task"):
        task(effect="idempotent", reconcile=t.was_charged)(t.charge_reconciled.func)
    with pytest.raises(InvalidTaskCall, match="does not import back"):
        task(effect="external", reconcile=lambda *a: None)(t.charge_reconciled.func)
    with pytest.raises(InvalidTaskCall, match="not a function's dotted path"):
        task(effect="external", reconcile="not a path")(t.charge_reconciled.func)


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ([("app.tasks.charge", {})], "must be a dict of task path"),
        ({"app.*.charge": {"effect": "pure"}}, "is not a task's dotted path"),
        ({"app.tasks.charge": {}}, "non-empty dict of options"),
        ({"app.tasks.charge": {"effects": "pure"}}, "unknown keys"),
        ({"app.tasks.*": {"effect": "pur"}}, "effect must be one of"),
        ({"app.tasks.*": {"reconcile": 42}}, "reconcile must be a module-level function"),
    ],
)
def test_options_for_tasks_one_does_not_own_that_cannot_be_right_stop_the_backend(given, said):
    with pytest.raises(ImproperlyConfigured, match=said):
        WorkflowsBackend("x", {"OPTIONS": {"tasks": given}})


def test_overrides_are_tried_the_most_specific_first():
    found = TaskOverride.all(
        "x",
        {
            "tasks": {
                "a.*": {"effect": "pure"},
                "a.b.c": {"effect": "external"},
                "a.b.*": {"effect": "idempotent"},
            }
        },
    )
    assert [o.pattern for o in found] == ["a.b.c", "a.b.*", "a.*"]
    assert [o.pattern for o in found if o.matches("a.b.d")] == ["a.b.*", "a.*"]
    assert not found[2].matches("ab.c")


def test_the_system_check_names_a_pattern_or_a_reconcile_that_leads_nowhere(settings):
    settings.TASKS = {
        **settings.TASKS,
        "checked": {
            "BACKEND": "k2b_workflows.tasks.WorkflowsBackend",
            "OPTIONS": {
                "reconcile": "tests.tasks_app.tasks.no_such_function",
                "tasks": {
                    "tests.tasks_app.tasks.no_such_task": {"effect": "pure"},
                    "tests.no_such_module.*": {"effect": "pure"},
                    "tests.tasks_app.tasks.was_charged": {"effect": "pure"},  # not a task
                    "tests.tasks_app.library.purge": {"effect": "pure"},  # another alias's
                    "tests.tasks_app.library.*": {"reconcile": "tests.tasks_app.tasks.Declined.x"},
                },
            },
        },
    }
    messages = [m.msg for m in check_task_overrides() if "'checked'" in m.msg]
    ids = {m.id for m in check_task_overrides()}
    assert ids == {"k2b_workflows.E041", "k2b_workflows.E042"}
    expected = [
        "no_such_function does not import",
        "no_such_task'] names no task: it does not import",
        "no_such_module.*'] names no task: module 'tests.no_such_module' does not import",
        "was_charged'] names no task: it is function, not a task",
        "purge']: that task is on backend 'default'",
        "Declined.x does not import",
    ]
    for text in expected:
        assert any(text in m for m in messages), (text, messages)
    assert len(messages) == len(expected)


def test_the_suites_own_settings_pass_the_system_check():
    assert check_task_overrides() == []
