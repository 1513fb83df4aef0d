"""Every bad input gets a clear error naming the field, and nothing is written.

Each boundary test counts the rows of every table before and after: an error
raised after a partial write would pass an ``assertRaises`` and still lose.
"""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import User
from django.test import override_settings

from k2b_workflows import (
    EFFECT_CONFIRMED,
    Action,
    Effect,
    IdempotencyConflict,
    InvalidInput,
    cancel_workflow_run,
    count_child_workflow_runs,
    notify_workflow_worker,
    resolve_effect,
    start_workflow_run,
    succeeded,
    wake_workflow_runs_waiting_on,
    workflow,
)
from k2b_workflows.control import retry_workflow_run
from k2b_workflows.exceptions import UnknownWorkflow
from k2b_workflows.models import WorkflowRun
from tests.support.misuse import Unchanged

pytestmark = pytest.mark.django_db(transaction=True)


def refused(call, match: str, exception: type[Exception] = InvalidInput) -> str:
    """Call, expect ``exception`` matching ``match``, check no row changed; return the message."""
    with Unchanged(), pytest.raises(exception, match=match) as info:
        call()
    return str(info.value)


# -- start_workflow_run ----------------------------------------------------------------


def test_none_input_is_refused_naming_the_input():
    refused(lambda: start_workflow_run("test.pure", None), "the workflow input must not be None")


def test_nul_in_input_is_refused_naming_where():
    message = refused(
        lambda: start_workflow_run("test.pure", {"a": ["ok", "x\x00"]}),
        "contains a NUL character",
    )
    assert "the workflow input['a'][1]" in message


def test_nul_in_principal_is_refused():
    refused(
        lambda: start_workflow_run("test.pure", {"a": 1}, principal={"user": "\x00"}),
        r"the principal\['user'\] contains a NUL",
    )


def test_non_string_object_keys_are_refused_not_renamed():
    refused(lambda: start_workflow_run("test.pure", {1: "x"}), "key 1 \\(int\\).*must be strings")


def test_nul_in_idempotency_key_is_refused():
    refused(
        lambda: start_workflow_run("test.pure", {"a": 1}, idempotency_key="k\x00"),
        "idempotency_key contains a NUL",
    )


def test_idempotency_key_over_its_column_is_refused():
    refused(
        lambda: start_workflow_run("test.pure", {"a": 1}, idempotency_key="k" * 256),
        "idempotency_key is 256 characters long, at most 255",
    )


def test_a_name_that_is_not_a_string_is_refused():
    refused(lambda: start_workflow_run(["x"], {}), "the workflow name must be a string, not list")


def test_a_parent_that_is_not_a_run_id_is_refused():
    refused(
        lambda: start_workflow_run("test.pure", {"a": 1}, parent="zzz"),
        "parent is not a run id",
    )


def test_a_parent_that_does_not_exist_is_refused():
    refused(
        lambda: start_workflow_run("test.pure", {"a": 1}, parent=uuid.uuid4()),
        "parent run .* does not exist",
    )


@override_settings(K2B_WORKFLOWS={"MAX_VALUE_BYTES": 1000})
def test_an_input_over_the_size_limit_is_refused_naming_the_setting():
    refused(
        lambda: start_workflow_run("test.pure", {"a": "x" * 2000}),
        r"the workflow input is 2\d{3} bytes as JSON, over the limit of 1000 "
        r"\(K2B_WORKFLOWS\['MAX_VALUE_BYTES'\]\)",
    )


def test_the_size_limit_has_a_default_well_below_postgresql_limits():
    with Unchanged(), pytest.raises(InvalidInput, match="over the limit of 1048576"):
        start_workflow_run("test.pure", {"a": "x" * (1 << 20)})


def test_json_nested_100000_deep_is_refused_without_a_recursion_error():
    deep: object = "leaf"
    for _ in range(100_000):
        deep = [deep]
    refused(lambda: start_workflow_run("test.pure", deep), "nested deeper than 100 levels")


def test_reusing_an_idempotency_key_with_another_input_names_the_existing_run():
    first = start_workflow_run("test.pure", {"a": 1, "b": 2}, idempotency_key="order-1")
    assert start_workflow_run("test.pure", {"b": 2, "a": 1}, idempotency_key="order-1") == first
    message = refused(
        lambda: start_workflow_run("test.pure", {"a": 1, "b": 3}, idempotency_key="order-1"),
        "already started run",
        IdempotencyConflict,
    )
    assert str(first.pk) in message
    with pytest.raises(IdempotencyConflict) as info:
        start_workflow_run("test.pure", {"a": 5}, idempotency_key="order-1")
    assert info.value.run_id == first.pk
    assert WorkflowRun.objects.get(pk=first.pk).input == {"a": 1, "b": 2}


# -- workflow() definitions -------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"effect_budget": {"u": True}}, r"effect_budget\['u'\] must be an int, not bool"),
        ({"max_steps": True}, "max_steps must be an int, not bool"),
        ({"max_ai_calls": False}, "max_ai_calls must be an int, not bool"),
        ({"max_steps": 2**31}, "max_steps must be between 1 and 2147483647"),
        ({"effect_budget": ["u"]}, "effect_budget must be a dict"),
        ({"version": True}, "version must be an int, not bool"),
    ],
)
def test_workflow_options_that_are_not_ints_are_refused(options, match):
    with pytest.raises(InvalidInput, match=match):
        workflow("misuse.bad_options", app_id="tests", **options)


# -- the other control functions --------------------------------------------------------


def test_cancel_with_a_malformed_run_id_is_refused():
    refused(lambda: cancel_workflow_run("zzz", "typo"), "run_id is not a run id")


def test_cancel_reason_with_nul_is_refused():
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    refused(lambda: cancel_workflow_run(run.pk, "why\x00"), "the cancel reason contains a NUL")
    assert WorkflowRun.objects.get(pk=run.pk).status == "queued"


def test_resolve_effect_with_a_malformed_run_id_is_refused():
    user = User.objects.create_superuser("root", password="x")
    refused(
        lambda: resolve_effect("not-a-uuid", EFFECT_CONFIRMED, evidence="seen", actor=user),
        "run_id is not a run id",
    )


def test_resolve_effect_evidence_with_nul_is_refused():
    user = User.objects.create_superuser("root", password="x")
    refused(
        lambda: resolve_effect(uuid.uuid4(), EFFECT_CONFIRMED, evidence="s\x00", actor=user),
        "the evidence contains a NUL",
    )


def test_retry_and_count_with_a_malformed_run_id_are_refused():
    user = User.objects.create_superuser("root", password="x")
    refused(lambda: retry_workflow_run("zzz", actor=user), "run_id is not a run id")
    refused(lambda: count_child_workflow_runs("zzz"), "run_id is not a run id")


def test_wake_key_with_nul_is_refused():
    refused(
        lambda: wake_workflow_runs_waiting_on(app_id="tests", kind="k", key="a\x00"),
        "key contains a NUL",
    )


def test_wake_key_over_its_column_is_refused():
    refused(
        lambda: wake_workflow_runs_waiting_on(app_id="tests", kind="k", key="k" * 501),
        "key is 501 characters long, at most 500",
    )


def test_notify_app_id_with_nul_is_refused():
    with pytest.raises(InvalidInput, match="app_id contains a NUL"):
        notify_workflow_worker("a\x00")


def test_unknown_workflow_is_still_unknown():
    refused(lambda: start_workflow_run("no.such", {}), "no workflow named", UnknownWorkflow)


# -- actions must say what they do ------------------------------------------------------


def test_an_action_without_effect_is_refused_when_the_class_is_created():
    with pytest.raises(TypeError, match=r"test_misuse\..*Charge declares no effect"):

        class Charge(Action):
            name = "misuse.charge"

            def run(self, ctx, input):
                return succeeded({})


def test_an_abstract_base_needs_no_effect_and_its_subclasses_inherit_one():
    class Base(Action, abstract=True):
        def run(self, ctx, input):
            return succeeded({"from": "base"})

    class External(Base):
        name = "misuse.external_base"
        effect = Effect.EXTERNAL

    class Inherits(External):
        name = "misuse.inherits"

    assert Inherits.effect == Effect.EXTERNAL
    with pytest.raises(TypeError, match="Concrete declares no effect"):

        class Concrete(Base):
            name = "misuse.concrete"
