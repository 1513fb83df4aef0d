"""Tasks "one does not own": a library's bare ``@task()``, given their options by
``OPTIONS["tasks"]`` in tests/settings.py (every task here idempotent, ``purge`` pure),
except where a task declares its own."""

from __future__ import annotations

from tests.tasks_app.tasks import declared, task


@task()
def reindex(pk):
    return pk


@task()
def purge(url):
    return url


@declared("external")
def sends(to):
    """Declares its own effect: the declaration wins over settings."""
    return to
