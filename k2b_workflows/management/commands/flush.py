"""``manage.py flush``, which empties the append-only tables only on a test database.

Django's own command would fail on the journal, ledger and budget charges
(their triggers refuse ``TRUNCATE``) with a database error naming one table.
This one says why before sending anything, and lets the one legitimate flush
through: Django's test teardown on a database its test runner created
(``k2b_workflows.testdb`` says exactly when, and why no production process
reaches it).
"""

from __future__ import annotations

from typing import Any

import pgtrigger
from django.core.management.base import CommandError
from django.core.management.commands.flush import Command as FlushCommand
from django.db import DEFAULT_DB_ALIAS, connections

from k2b_workflows import testdb


class Command(FlushCommand):
    help = (
        FlushCommand.help
        + " Refused, because the workflow journal, ledger and budget charges are append-only, "
        "except on a test database Django's test runner created (purgeworkflows deletes old "
        "run trees)."
    )

    def handle(self, **options: Any) -> None:
        using = options.get("database") or DEFAULT_DB_ALIAS
        name = connections[using].settings_dict["NAME"]
        if not testdb.created_by_test_runner(using):
            raise CommandError(
                f"flush refused on database {name!r} (alias {using!r}): the workflow journal, "
                "ledger and budget charges are append-only evidence, and the database refuses "
                "to empty them. Only a test database created by Django's test runner in this "
                "process is flushed (TransactionTestCase, pytest-django transaction=True). "
                "To delete old finished runs use `manage.py purgeworkflows`; to start afresh "
                "on a development database, drop and re-create it."
            )
        with pgtrigger.ignore(*testdb.APPEND_ONLY_TRIGGERS, databases=[using]):
            super().handle(**options)
