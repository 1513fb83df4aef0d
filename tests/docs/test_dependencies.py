"""What ``pip install k2b-workflows`` pulls in is what the package imports.

``django-environ`` was a hard dependency that nothing in ``k2b_workflows``
imports: every project installing the app got a package only the example
project uses (#38). It is the ``example`` extra now; this keeps each hard
dependency one the package really imports.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import tomllib
from pathlib import Path

import k2b_workflows
from tests.support.processes import ROOT

PACKAGE = Path(k2b_workflows.__file__).resolve().parent


def imported_top_level_names() -> set[str]:
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


def distribution(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_every_hard_dependency_is_imported_by_the_package():
    project = tomllib.loads((Path(ROOT) / "pyproject.toml").read_text())["project"]
    by_import = importlib.metadata.packages_distributions()
    imported = {
        dist.lower().replace("_", "-")
        for name in imported_top_level_names()
        for dist in by_import.get(name, [])
    }
    unused = [r for r in project["dependencies"] if distribution(r) not in imported]
    assert unused == [], f"hard dependencies k2b_workflows never imports: {unused}"


def test_the_example_project_and_the_suite_get_django_environ_from_an_extra():
    extras = tomllib.loads((Path(ROOT) / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra in ("example", "test", "dev"):
        assert "django-environ" in {distribution(r) for r in extras[extra]}, extra
