"""Bad input loses nothing (``Unchanged``), and what ``verifyworkflows`` says of an attack."""

from __future__ import annotations

import io

from django.apps import apps
from django.core.management import CommandError, call_command


def verify() -> str:
    """What ``verifyworkflows`` printed on the test database, and ``FAILED <why>`` when it
    failed: a test reads which runs it named, and why."""
    out = io.StringIO()
    try:
        call_command("verifyworkflows", "--database", "default", stdout=out)
    except CommandError as exc:
        return f"{out.getvalue()}FAILED {exc}"
    return out.getvalue()


def row_counts() -> dict[str, int]:
    """Rows of every table of the app (and of the tests' own tables)."""
    counts = {}
    for label in ("k2b_workflows", "tests"):
        for model in apps.get_app_config(label).get_models():
            if not model._meta.proxy:
                counts[model._meta.db_table] = model._default_manager.count()
    return counts


class Unchanged:
    """``with Unchanged():`` fails the test if any table gained or lost a row."""

    def __enter__(self) -> Unchanged:
        self.before = row_counts()
        return self

    def __exit__(self, *exc: object) -> None:
        assert row_counts() == self.before
