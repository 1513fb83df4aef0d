"""Tasks declaring ``Unique`` (#49): one run per key of their calls.

Declared with ``@task(unique=...)`` on Django 6.1 and the backport; on Django
6.0, whose ``@task`` takes no extra arguments, by ``OPTIONS["tasks"]`` in
tests/settings.py (``UNIQUE_TASKS``), which a declaration on the task wins over.
"""

from __future__ import annotations

from django.conf import settings

from k2b_workflows import Unique
from tests.tasks_app.tasks import EXTRA_ARGUMENTS, task


def declared(name: str) -> Unique:
    """The task's declaration, as tests/settings.py gives it on Django 6.0."""
    return settings.TASKS["default"]["OPTIONS"]["tasks"][f"{__name__}.{name}"]["unique"]


def unique(name: str, **options):
    if EXTRA_ARGUMENTS:
        return task(unique=declared(name), **options)
    return task(**options)


@unique("rebuild_index")
def rebuild_index(site_id, verbose=False):
    return {"site": site_id, "verbose": verbose}


@unique("recent")
def recent(site_id):
    return site_id


@unique("kept")
def kept(site_id):
    return site_id


@unique("every_argument")
def every_argument(a, b=2, **extra):
    return a + b


@unique("replaced")
def replaced(site_id, note=""):
    return note


@unique("debounced")
def debounced(site_id, note=""):
    return note


@unique("with_context", takes_context=True)
def with_context(context, site_id):
    return site_id


@task()
def by_settings(site_id, note=""):
    """Declared only by ``OPTIONS["tasks"]`` (the same on every Django)."""
    return note


def undeclared(site_id):
    """A function tests declare tasks of (a task's function is defined at module level)."""
    return site_id
