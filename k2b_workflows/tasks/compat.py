"""django.tasks: Django's own (6.0 and later), else the ``django-tasks`` backport.

The two spell a few names differently; every other module of the package
reads django.tasks through the names here, so that a difference between
them is handled once.
"""

from __future__ import annotations

import importlib
from typing import Any


def _api(name: str) -> Any:
    """A module of django.tasks: Django's own (6.0+), else the ``django-tasks`` backport."""
    try:
        return importlib.import_module(f"django.tasks{name}")
    except ImportError:
        return importlib.import_module(f"django_tasks{name}")


tasks_api = _api("")
base_api = _api(".base")
signals_api = _api(".signals")
exceptions_api = _api(".exceptions")
backends_api = _api(".backends.base")
#: Django calls it ``InvalidTask``; the backport ``InvalidTaskError``.
InvalidTask: type[Exception] = getattr(exceptions_api, "InvalidTask", None) or (
    exceptions_api.InvalidTaskError
)
TaskResultDoesNotExist: type[Exception] = exceptions_api.TaskResultDoesNotExist
TaskResultMismatch: type[Exception] = exceptions_api.TaskResultMismatch
