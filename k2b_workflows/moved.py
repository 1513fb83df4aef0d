"""Old import paths of modules that moved, kept working for one release.

The admin, the worker process, the django.tasks backend and the models
became packages of their own (``k2b_workflows.admin``, ``k2b_workflows.worker``,
``k2b_workflows.tasks``, ``k2b_workflows.models``). A host project that
imported one of their modules by its old path (``k2b_workflows.logformat`` in a
``LOGGING`` setting, ``k2b_workflows.health`` in a probe script,
``k2b_workflows.taskruns``, ``k2b_workflows.schedule_models``) must not break
on upgrade: the finder below answers for the old names, warns with a
``DeprecationWarning`` naming the new path, and hands back the very module
object that lives there, so a monkeypatch or an ``isinstance`` through either
path sees one module. No file stands at an old path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Sequence

#: Old module name → where it lives now. The CHANGELOG lists the same moves.
MOVED: dict[str, str] = {
    "k2b_workflows.admin_display": "k2b_workflows.admin.display",
    "k2b_workflows.admin_overview": "k2b_workflows.admin.overview_views",
    "k2b_workflows.admin_schedules": "k2b_workflows.admin.schedules",
    "k2b_workflows.admin_views": "k2b_workflows.admin.views",
    "k2b_workflows.forms": "k2b_workflows.admin.forms",
    "k2b_workflows.overview": "k2b_workflows.admin.overview",
    "k2b_workflows.exits": "k2b_workflows.worker.exits",
    "k2b_workflows.health": "k2b_workflows.worker.health",
    "k2b_workflows.logformat": "k2b_workflows.worker.logformat",
    "k2b_workflows.prefetch": "k2b_workflows.worker.prefetch",
    "k2b_workflows.startup": "k2b_workflows.worker.startup",
    "k2b_workflows.stop_signals": "k2b_workflows.worker.stop_signals",
    "k2b_workflows.supervisor": "k2b_workflows.worker.supervisor",
    "k2b_workflows.timeouts": "k2b_workflows.worker.timeouts",
    "k2b_workflows.topology": "k2b_workflows.worker.topology",
    "k2b_workflows.wakeups": "k2b_workflows.worker.wakeups",
    "k2b_workflows.taskruns": "k2b_workflows.tasks.runs",
    "k2b_workflows.ai_models": "k2b_workflows.models.ai",
    "k2b_workflows.batch_models": "k2b_workflows.models.batches",
    "k2b_workflows.budget_models": "k2b_workflows.models.budgets",
    "k2b_workflows.fleet_models": "k2b_workflows.models.fleet",
    "k2b_workflows.flow_models": "k2b_workflows.models.flow",
    "k2b_workflows.overview_models": "k2b_workflows.models.overview",
    "k2b_workflows.progress_models": "k2b_workflows.models.progress",
    "k2b_workflows.queue_models": "k2b_workflows.models.queues",
    "k2b_workflows.schedule_models": "k2b_workflows.models.schedules",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names of moved modules and loads them as their new modules."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old path will be removed in the next release",
            DeprecationWarning,
            stacklevel=_importer_stacklevel(),
        )
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to execute: give the module back the spec of its new name.

        The import system keeps an existing module's ``__name__`` and
        ``__loader__`` but sets ``__spec__`` to the old name's spec; a reload, or
        anything else that reads the spec, must still find the new module.
        """
        assert module.__spec__ is not None
        module.__spec__ = self._specs[module.__spec__.name]


def _importer_stacklevel() -> int:
    """The stack level of the frame whose import named the old path.

    Between ``warnings.warn`` and that frame lie this module's frames, the
    import system's (which ``warnings`` skips by itself and so must not be
    counted) and, for ``importlib.import_module``, that function's frame. A
    warning pointed at any of them tells the reader nothing.
    """
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith("<frozen importlib"):
            pass
        elif filename in (__file__, importlib.__file__):
            level += 1
        else:
            break
        frame = frame.f_back  # type: ignore[assignment]
    return level


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (the package's ``__init__`` calls it)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
