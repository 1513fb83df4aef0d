"""Modules that moved into packages (admin, worker, tasks, models) keep their old paths."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from k2b_workflows.moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_gives_the_module_at_its_new_path(old):
    new = MOVED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}") as record:
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    # The warning points at the importer, not at the import system's frames.
    assert record[0].filename == __file__
    # The module keeps its own name and spec: a reload or a pickle finds it where it lives.
    assert module.__name__ == new
    assert module.__spec__.name == new


def test_the_old_from_import_form_works_too():
    sys.modules.pop("k2b_workflows.logformat", None)
    with pytest.warns(DeprecationWarning, match="k2b_workflows.worker.logformat"):
        from k2b_workflows.logformat import JsonFormatter
    from k2b_workflows.worker.logformat import JsonFormatter as moved

    assert JsonFormatter is moved


def test_no_file_stands_at_an_old_path():
    import k2b_workflows

    package_dir = Path(k2b_workflows.__path__[0])
    for old in MOVED:
        leaf = old.rsplit(".", 1)[1]
        assert not (package_dir / f"{leaf}.py").exists(), old


def test_names_that_never_existed_are_still_missing():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("k2b_workflows.no_such_module")
