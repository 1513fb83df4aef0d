"""Retry policies per action and per workflow override the settings for their steps."""

from __future__ import annotations

import datetime as dt

import pytest

from k2b_workflows import Action, Effect, InvalidInput, Retry, start_workflow_run, workflow
from k2b_workflows.models import WorkflowRun
from k2b_workflows.store import WORKFLOW_RETRY_EXHAUSTED
from k2b_workflows.testing import assert_run_status, controlled_clock, run_until_idle
from tests.support.kernel import execute_once
from tests.workflows.callers import calls

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_action_policy_allows_more_attempts_than_the_setting_and_the_clock_skips_its_hours():
    # The settings allow 5 attempts; the action's policy 8, an hour apart at first.
    run = start_workflow_run("callers.patient", {"ok_at": 7})
    with controlled_clock() as clock:
        assert execute_once(run) == "retry"
        row = WorkflowRun.objects.get(pk=run.pk)
        wait = row.run_after - clock.now()
        # An hour, less up to half of it by the jitter (and the few ms since).
        assert dt.timedelta(minutes=29) < wait <= dt.timedelta(hours=1), wait
        run_until_idle(app_ids=["tests"])
        assert clock.offset > dt.timedelta(hours=4)  # the backoff passed on the clock only
    assert_run_status(run, "succeeded")
    assert calls("callers.patient") == 7


def test_an_action_policy_of_eight_attempts_exhausts_after_eight():
    run = start_workflow_run("callers.patient", {"ok_at": 100})
    with controlled_clock():
        run_until_idle(app_ids=["tests"])
    assert_run_status(run, "failed", error_code=WORKFLOW_RETRY_EXHAUSTED)
    assert calls("callers.patient") == 8


def test_an_action_policy_of_one_attempt_never_retries():
    run = start_workflow_run("callers.one_shot", {"ok_at": 2})
    run_until_idle(app_ids=["tests"])
    assert_run_status(run, "failed", error_code=WORKFLOW_RETRY_EXHAUSTED)
    assert calls("callers.one_shot") == 1


def test_without_a_policy_the_settings_bound_holds():
    run = start_workflow_run("callers.flaky", {"ok_at": 100})
    with controlled_clock():
        run_until_idle(app_ids=["tests"])
    assert_run_status(run, "failed", error_code=WORKFLOW_RETRY_EXHAUSTED)
    assert calls("callers.flaky") == 5  # RUN_MAX_CONSECUTIVE_FAILURES' default


def test_a_non_retryable_code_fails_the_step_with_that_code_at_once():
    run = start_workflow_run("callers.declines", {"ok_at": 3, "code": "CARD_DECLINED"})
    run_until_idle(app_ids=["tests"])
    assert_run_status(run, "failed", error_code="CARD_DECLINED")
    assert calls("callers.declines") == 1

    other = start_workflow_run("callers.declines", {"ok_at": 3, "code": "TIMEOUT"})
    run_until_idle(app_ids=["tests"])
    assert_run_status(other, "succeeded")


def test_the_workflow_policy_applies_to_its_steps_and_the_action_policy_wins_over_it():
    run = start_workflow_run("callers.workflow_policy", {"ok_at": 9})
    with controlled_clock() as clock:
        assert execute_once(run) == "retry"
        wait = WorkflowRun.objects.get(pk=run.pk).run_after - clock.now()
        assert dt.timedelta(minutes=4) < wait <= dt.timedelta(minutes=10), wait
        run_until_idle(app_ids=["tests"])
    assert_run_status(run, "succeeded")
    assert calls("callers.flaky") == 9  # past the settings' 5: the workflow's 9


def test_an_exception_is_retried_under_the_workflow_policy():
    run = start_workflow_run("callers.raises_twice", {})
    run_until_idle(app_ids=["tests"])
    assert_run_status(run, "failed", error_code=WORKFLOW_RETRY_EXHAUSTED)
    assert calls("callers.raises") == 2


def test_delays_double_up_to_the_cap_without_jitter_and_stay_within_half_with_it():
    policy = Retry(5, backoff=1, max_backoff=dt.timedelta(seconds=5), jitter=False)
    assert [policy.delay_ms(n) for n in range(1, 6)] == [1000, 2000, 4000, 5000, 5000]
    tripled = Retry(5, backoff=1, max_backoff=100, multiplier=3, jitter=False)
    assert [tripled.delay_ms(n) for n in range(1, 4)] == [1000, 3000, 9000]
    jittered = Retry(5, backoff=10)
    assert all(5000 <= jittered.delay_ms(1) <= 10000 for _ in range(50))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": True}, "max_attempts"),
        ({"max_attempts": 2.5}, "max_attempts"),
        ({"max_attempts": 3, "backoff": -1}, "backoff"),
        ({"max_attempts": 3, "backoff": "1s"}, "backoff"),
        ({"max_attempts": 3, "backoff": 10, "max_backoff": 1}, "max_backoff"),
        ({"max_attempts": 3, "multiplier": 0.5}, "multiplier"),
        ({"max_attempts": 3, "jitter": "yes"}, "jitter"),
        ({"max_attempts": 3, "non_retryable_codes": "CARD_DECLINED"}, "non_retryable_codes"),
        ({"max_attempts": 3, "non_retryable_codes": ("",)}, "non_retryable_codes"),
    ],
)
def test_an_invalid_policy_is_refused_naming_the_field(kwargs, field):
    with pytest.raises(InvalidInput, match=rf"Retry\.{field}"):
        Retry(**kwargs)


def test_a_policy_that_is_not_a_retry_is_refused_on_the_action_and_the_workflow():
    with pytest.raises(InvalidInput, match=r"Bad\.retry"):

        class Bad(Action):
            effect = Effect.PURE
            retry = 3

    with pytest.raises(InvalidInput, match="retry must be a Retry"):
        workflow("callers.bad_retry", app_id="tests", retry={"max_attempts": 3})


def test_a_crash_counts_against_the_step_policy_bound():
    from k2b_workflows.testing import crash_after_effect
    from tests.workflows.callers import OnceOnly

    # One attempt allowed: the crash (a lease that runs out) was it.
    run = start_workflow_run("callers.once_only", {})
    with crash_after_effect(OnceOnly):
        run_until_idle(app_ids=["tests"])
    assert_run_status(run, "failed", error_code=WORKFLOW_RETRY_EXHAUSTED)
    assert calls("callers.once_only") == 1


@pytest.mark.parametrize(
    ("raised", "attempts", "status"),
    [
        ("ConnectionError", 3, "succeeded"),  # named
        ("ConnectionResetError", 3, "succeeded"),  # a subclass of one named
        ("TimeoutError", 3, "succeeded"),  # named by its path
        ("ValueError", 1, "failed"),  # not named: fails at once
    ],
)
def test_retry_on_retries_only_the_exceptions_it_names(raised, attempts, status):
    run = start_workflow_run("callers.picky", {"ok_at": 3, "raise": raised})
    run_until_idle(app_ids=["tests"])
    assert_run_status(run, status)
    row = WorkflowRun.objects.get(pk=run.pk)
    assert calls("callers.picky") == attempts
    if status == "failed":
        assert row.error_code == "ACTION_FAILED", row.error_message
        assert "ValueError: flaky provider" in row.error_message
        assert "Retry(on=...) does not name it" in row.error_message


def test_retry_on_is_kept_as_class_paths_and_refuses_what_names_no_exception():
    policy = Retry(3, on=(ConnectionError, "TimeoutError", "tests.tasks_app.tasks.Declined"))
    assert policy.on == (
        "builtins.ConnectionError",
        "builtins.TimeoutError",
        "tests.tasks_app.tasks.Declined",
    )
    assert Retry(3, on=KeyError).on == ("builtins.KeyError",)
    assert policy.retries_exception(ConnectionRefusedError()) is True
    assert policy.retries_exception(KeyError()) is False
    assert Retry(3).retries_exception(KeyError()) is True  # empty: every exception
    for bad, said in [
        ("NoSuchError", "does not import"),
        ("os.path", "exception classes only"),
        (int, "exception classes only"),
        (42, "exception class or a tuple"),
    ]:
        with pytest.raises(InvalidInput, match=said):
            Retry(3, on=bad)
