"""docs/reference.md's signatures and ``runworkflows`` line are rendered from the code.

Written by hand, they fell behind it: ``@workflow`` lost ``retry=`` and
``timeout=``, the ``runworkflows`` line ``--processes`` (#38). Each test renders
the text from the code (``inspect.signature``, the command's own parser) and
finds it on the page; a failure prints the line to paste.
"""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.core.management import load_command_class

import k2b_workflows
from tests.support.processes import ROOT

PAGE = Path(ROOT, "docs", "reference.md")
#: Options every Django command has: the page lists a command's own.
DJANGO_OPTIONS = {
    "help",
    "version",
    "verbosity",
    "settings",
    "pythonpath",
    "traceback",
    "no_color",
    "force_color",
    "skip_checks",
}


def signature(name: str, obj: Callable[..., Any]) -> str:
    """``name(a, *, b="x", c=None)``: names, kinds and defaults, no annotations."""
    parts: list[str] = []
    star = False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.default is p.empty:
            parts.append(p.name)
        elif isinstance(p.default, str):
            parts.append(f'{p.name}="{p.default}"')
        else:
            parts.append(f"{p.name}={p.default!r}")
    return f"{name}({', '.join(parts)})"


def usage(command: str) -> str:
    """``command [--opt METAVAR] [--flag] [--many M ...]`` in the parser's order."""
    parser = load_command_class("k2b_workflows", command).create_parser("manage.py", command)
    parts = [command]
    for action in parser._actions:
        if action.dest in DJANGO_OPTIONS:
            continue
        option = next(o for o in action.option_strings if o.startswith("--"))
        if action.nargs == 0:
            parts.append(f"[{option}]")
            continue
        metavar = action.metavar or (
            "{" + ",".join(action.choices) + "}" if action.choices else action.dest.upper()
        )
        many = " ..." if isinstance(action, argparse._AppendAction) else ""
        parts.append(f"[{option} {metavar}{many}]")
    return " ".join(parts)


def page() -> str:
    return " ".join(PAGE.read_text().split())  # a signature may wrap in the prose


@pytest.mark.parametrize(
    ("shown", "obj"),
    [
        ("@workflow", k2b_workflows.workflow),
        ("Schedule", k2b_workflows.Schedule),
        ("schedule_workflow", k2b_workflows.schedule_workflow),
        ("start_workflow_run", k2b_workflows.start_workflow_run),
    ],
)
def test_each_signature_on_the_reference_page_is_the_codes(shown, obj):
    rendered = signature(shown, obj)
    assert f"`{rendered}`" in page(), f"docs/reference.md should show `{rendered}`"


def test_the_runworkflows_line_lists_every_option_of_the_command():
    rendered = usage("runworkflows")
    lines = [x for x in PAGE.read_text().splitlines() if re.match(r"- `runworkflows\b", x)]
    assert lines == [f"- `{rendered}`"], f"docs/reference.md should list `{rendered}`"


#: Public names of ``Action`` that are the framework's, not a subclass's to set.
ACTION_HELPERS = {"abstract", "action_name", "defines", "definition_hash"}


def test_the_action_table_lists_every_attribute_and_hook_of_action():
    """``redispatch_when_absent`` and ``retry`` were missing from the table (#38): every
    public attribute a subclass sets, and every hook it defines, has a row."""
    table = PAGE.read_text().split("### `Action`", 1)[1].split("\n### ", 1)[0]
    rows = {re.sub(r"\(.*\)$", "", cell) for cell in re.findall(r"^\| `([^`]+)` \|", table, re.M)}
    public = set(k2b_workflows.Action.__annotations__) | set(vars(k2b_workflows.Action))
    expected = {name for name in public if not name.startswith("_")} - ACTION_HELPERS
    assert expected - rows == set(), (
        f"rows to add to reference.md's Action table: {expected - rows}"
    )
    assert rows - expected == set(), f"rows for names Action no longer has: {rows - expected}"
