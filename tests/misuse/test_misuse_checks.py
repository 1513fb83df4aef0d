"""Actions declare what they do (the docs' examples: tests/docs/test_docs.py)."""

from __future__ import annotations

from k2b_workflows import Action, Effect, succeeded
from k2b_workflows.checks import check_actions


def messages_about(cls: type) -> dict[str, str]:
    return {m.id: m.msg for m in check_actions() if m.obj is cls}


def test_a_non_pure_action_without_plan_is_a_warning_naming_it():
    class SendSms(Action):
        name = "misuse.send_sms"
        effect = Effect.IDEMPOTENT

        def run(self, ctx, input):
            return succeeded({})

    found = messages_about(SendSms)
    assert set(found) == {"k2b_workflows.W010"}
    assert "SendSms is IDEMPOTENT and defines no plan()" in found["k2b_workflows.W010"]


def test_an_action_without_a_name_is_a_warning_naming_the_default():
    class Unnamed(Action):
        effect = Effect.PURE

        def run(self, ctx, input):
            return succeeded({})

    found = messages_about(Unnamed)
    assert set(found) == {"k2b_workflows.W011"}
    assert "journal records it as 'tests.misuse.test_misuse_checks." in found["k2b_workflows.W011"]


def test_a_name_inherited_from_a_base_counts_and_abstract_bases_are_not_checked():
    class Base(Action, abstract=True):
        name = "misuse.base"

    class Child(Base):
        effect = Effect.PURE

        def run(self, ctx, input):
            return succeeded({})

    assert messages_about(Base) == {}
    assert messages_about(Child) == {}
