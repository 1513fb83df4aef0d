"""The documentation's code runs: the tutorial is the demo, and the demo is tested here.

The tutorial (docs/tutorial.md) includes ``example_project/demo/workflows.py``
section by section when the site is built, so running the demo command and
dry-running its workflows tests what the reader sees. Every other Python block
in the docs must at least be valid Python.
"""

from __future__ import annotations

import ast
import io
import re
from pathlib import Path

import pytest
from django.core.management import call_command

from k2b_workflows import dry_run
from k2b_workflows.models import LedgerEntry, WorkflowRun

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.M)


def python_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in DOC_FILES:
        for i, match in enumerate(BLOCK.finditer(path.read_text())):
            # Blocks included from source files are run by the rest of the suite.
            if not SNIPPET.search(match.group(1)):
                blocks.append((f"{path.relative_to(ROOT)}#{i + 1}", match.group(1)))
    return blocks


@pytest.mark.parametrize(("where", "code"), python_blocks(), ids=[w for w, _ in python_blocks()])
def test_every_python_example_in_the_docs_is_valid_python(where: str, code: str) -> None:
    # Examples elide with "..." inside lists and calls; that is valid Python already.
    ast.parse(code, filename=where)


def test_every_snippet_the_tutorial_includes_exists() -> None:
    tutorial = (ROOT / "docs" / "tutorial.md").read_text()
    includes = SNIPPET.findall(tutorial)
    assert includes, "the tutorial includes the demo's code"
    for include in includes:
        path, _, section = include.partition(":")
        source = (ROOT / path).read_text()
        assert f"# --8<-- [start:{section}]" in source, include
        assert f"# --8<-- [end:{section}]" in source, include


DEMO_INPUTS = {
    "shop.checkout": {
        "sku": "TEA-01",
        "items": ["teapot", "cup"],
        "amount_cents": 2_900,
        "customer": "ada@example.com",
    },
    "shop.ship_item": {"order_id": 1, "item": "teapot"},
    "shop.payout": {"amount_cents": 12_500},
}


@pytest.mark.django_db
@pytest.mark.parametrize("name", sorted(DEMO_INPUTS))
def test_a_dry_run_of_every_demo_workflow_is_ok(name: str) -> None:
    report = dry_run(name, DEMO_INPUTS[name], principal={"user": "docs"})
    assert report.ok, [(s.seq, s.action, s.error) for s in report.steps]
    assert report.within_budget
    assert report.steps, "a dry run reports the planned steps"


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_the_demo_settles_as_the_tutorial_says() -> None:
    out = io.StringIO()
    call_command("demo", concurrency=2, timeout=120, stdout=out, stderr=out)
    text = out.getvalue()
    runs = WorkflowRun.objects.filter(parent__isnull=True)
    by_status = {
        status: runs.filter(status=status).count()
        for status in ("succeeded", "needs_attention", "canceled")
    }
    # Five checkouts (one reconciled after a provider timeout, two approved by a
    # person), the bank payout that only an operator can settle, one canceled.
    assert by_status == {"succeeded": 5, "needs_attention": 1, "canceled": 1}, text
    payout = runs.get(workflow_name="shop.payout")
    assert payout.error_code == "EFFECT_OUTCOME_UNKNOWN"
    kettle = runs.get(workflow_name="shop.checkout", input__sku="KETTLE")
    assert LedgerEntry.objects.filter(run=kettle, kind="outcome_unknown").exists()
    from example_project.demo.models import Payment

    # One charge per succeeded checkout, the timed-out one included.
    assert Payment.objects.count() == 5
    assert "Incidents waiting for an operator: 1" in text
    assert "/admin/k2b_workflows/incident/" in text
