"""Actions declare what they do; the docs' examples pass the checks and a dry run."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

import k2b_workflows
from k2b_workflows import Action, Effect, dry_run, succeeded, workflows
from k2b_workflows.checks import check_actions

DOCS = Path(__file__).resolve().parent.parent / "docs"


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
    assert "journal records it as 'tests.test_misuse_checks." in found["k2b_workflows.W011"]


def test_a_name_inherited_from_a_base_counts_and_abstract_bases_are_not_checked():
    class Base(Action, abstract=True):
        name = "misuse.base"

    class Child(Base):
        effect = Effect.PURE

        def run(self, ctx, input):
            return succeeded({})

    assert messages_about(Base) == {}
    assert messages_about(Child) == {}


def public_api() -> dict:
    return {name: getattr(k2b_workflows, name) for name in k2b_workflows.__all__}


def docs_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in sorted(DOCS.glob("*.md")):
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
            if re.search(r"^class \w+\(Action\)", block, re.M):
                blocks.append((path.name, block))
    return blocks


@pytest.fixture
def scratch_registry():
    """Run the docs' definitions without replacing the example project's workflows."""
    saved = {name: dict(versions) for name, versions in workflows._registry.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "docs.shop.checkout replaces ..."
        yield
    workflows._registry.clear()
    workflows._registry.update(saved)


@pytest.mark.parametrize(("page", "block"), docs_blocks())
def test_every_action_in_the_docs_declares_effect_and_name_and_plans_if_not_pure(
    page, block, scratch_registry
):
    # The blocks of a page build on its earlier imports: give them the public API.
    namespace: dict = {"__name__": f"docs.{page}", **public_api()}
    exec(compile(block, page, "exec"), namespace)
    actions = [v for v in namespace.values() if isinstance(v, type) and issubclass(v, Action)]
    actions = [a for a in actions if a is not Action]
    assert actions
    for action in actions:
        assert action.name, action
        assert action.effect == Effect.PURE or action.defines("plan"), action


@pytest.mark.django_db
def test_the_docs_checkout_passes_a_dry_run(scratch_registry):
    text = (DOCS / "getting-started.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "checkout" in b)
    exec(compile(block, "getting-started.md", "exec"), {"__name__": "docs.shop"})
    report = dry_run("shop.checkout", {"sku": "TEA-01", "amount": 2900})
    assert report.ok, (report.errors, report.failed)
    assert [s.action for s in report.steps] == ["shop.create_order", "shop.charge_card"]
