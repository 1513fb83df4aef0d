"""Reading the docs' code blocks, and loading docs/examples modules in a registry of their own.

The examples reuse names the demo shop registers too (``shop.checkout``), and
three of them define version 1 of one workflow three ways (docs/changing-code.md).
``examples(...)`` therefore runs each in an empty registry of workflows and AI
providers, imports the modules afresh (their decorators register what the page
shows) and puts the suite's registry back afterwards.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from k2b_workflows import workflows
from k2b_workflows.kernel import ai

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
#: The pages the site builds, and the README (GitHub shows it; no snippets there).
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$')


@dataclass(frozen=True)
class Block:
    page: str  # "docs/effects.md" or "README.md"
    index: int  # 1-based among the page's blocks of this language
    language: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page}#{self.language}{self.index}"

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0] if self.code else ""

    @property
    def includes(self) -> list[str]:
        """The ``path:section`` of every snippet line; [] unless the block is only includes."""
        lines = [line for line in self.code.splitlines() if line.strip()]
        found = [SNIPPET.match(line) for line in lines]
        if not lines or not all(found):
            return []
        return [m.group(1) for m in found if m]


def blocks(language: str) -> list[Block]:
    found = []
    for path in DOC_FILES:
        counter = 0
        for match in BLOCK.finditer(path.read_text()):
            if match.group(1) == language:
                counter += 1
                found.append(Block(str(path.relative_to(ROOT)), counter, language, match.group(2)))
    return found


def block(page: str, first_line: str, language: str = "python") -> Block:
    """The one block of ``page`` whose first line is ``first_line``."""
    (found,) = [b for b in blocks(language) if b.page == page and b.first_line == first_line]
    return found


def section(include: str) -> str:
    """The text pymdownx.snippets puts on the page for ``path:section`` (dedented)."""
    import textwrap

    path, _, name = include.partition(":")
    lines = (ROOT / path).read_text().splitlines()
    start, end = f"# --8<-- [start:{name}]", f"# --8<-- [end:{name}]"
    stripped = [line.strip() for line in lines]
    first, last = stripped.index(start), stripped.index(end)
    body = [line for line in lines[first + 1 : last] if "# --8<-- [" not in line]
    return textwrap.dedent("\n".join(body)) + "\n"


@contextlib.contextmanager
def examples(*names: str) -> Iterator[tuple[ModuleType, ...]]:
    """Import ``docs.examples.<name>`` for each name, alone in the registries; yield the modules."""
    from docs.examples import providers

    saved_workflows = {name: dict(versions) for name, versions in workflows._registry.items()}
    saved_providers = dict(ai._providers)
    workflows._registry.clear()
    ai._providers.clear()
    providers.reset()
    try:
        modules = []
        for name in names:
            full = f"docs.examples.{name}"
            # A fresh module, not a reload: functions registered by an earlier load
            # keep the globals they were defined with.
            sys.modules.pop(full, None)
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # two modules, one workflow
                modules.append(importlib.import_module(full))
        yield tuple(modules)
    finally:
        workflows._registry.clear()
        workflows._registry.update(saved_workflows)
        ai._providers.clear()
        ai._providers.update(saved_providers)
        providers.reset()
