"""Which databases Django's test runner created: the only ones ``flush`` may empty.

The journal, the ledger and the budget charges are append-only: the database
refuses ``UPDATE``, ``DELETE`` and ``TRUNCATE`` of them (``models/journal.py``,
``models/budgets.py``). Django empties every table with ``manage.py flush``
after each ``TransactionTestCase`` (and each pytest-django test marked
``transaction=True``), and that flush
failed on them in every project, with "k2b_journal is append-only, TRUNCATE is
refused". A bypass that a production process could reach by accident would
make the evidence deletable; one that no test could reach would make the
documented test styles fail.

So the bypass is narrow. A database is flushable only when both hold, in this
process:

- Django's test environment is set up (``setup_test_environment()``, which
  Django's test runner and pytest-django call before creating test databases,
  and which nothing in a production process calls), and
- the connection's database ``NAME`` is one that the test runner migrated
  after ``create_test_db()`` switched the connection to it (recorded here on
  ``post_migrate`` while the test environment is set up), or a clone of one
  made for ``manage.py test --parallel`` (``<name>_<n>``).

Anything else is refused with a clear error before a statement is sent, and
the database's own refusal (the triggers, the runtime role's missing
privileges) stays as it was: a ``TRUNCATE`` from ``psql`` or any other code is
refused exactly as before.

The other failure at a test database's end (#38): a test of a view that waits
for a result starts the process's result listener, whose LISTEN connection
outlives the test, so the test runner's ``DROP DATABASE`` failed with
"database ... is being accessed by other users" (``manage.py test`` exited 1
and left the database behind; pytest-django warned "Error when trying to
teardown test databases"). Both runners drop a test database, and create or
clone one, through a connection to no database (Django's ``_nodb_cursor``);
when one opens while the test environment is set up, the listener is closed
first (``release_before_drop``). It starts again at the next wait, so a
runner that creates a database after dropping one loses nothing.
"""

from __future__ import annotations

import re
from typing import Any

from django.db import connections
from django.db.backends.base.base import NO_DB_ALIAS

#: The triggers a flush steps past: the row-level refusal of DELETE (a flush
#: made of DELETEs) and the statement-level refusal of TRUNCATE.
APPEND_ONLY_TRIGGERS = (
    "k2b_workflows.JournalEntry:journal_append_only",
    "k2b_workflows.LedgerEntry:ledger_append_only",
    "k2b_workflows.BudgetCharge:charge_append_only",
    "k2b_workflows.JournalEntry:journal_no_truncate",
    "k2b_workflows.LedgerEntry:ledger_no_truncate",
    "k2b_workflows.BudgetCharge:charge_no_truncate",
)

#: Database names the test runner created and migrated in this process.
_created: set[str] = set()


def test_environment_active() -> bool:
    """True between Django's ``setup_test_environment()`` and its teardown.

    Read from the state Django keeps for that teardown: should a future
    Django keep it elsewhere, this answers False and flushes are refused
    (the safe side), never the reverse.
    """
    try:
        from django.test.utils import _TestState
    except ImportError:  # pragma: no cover - a Django without it
        return False
    return hasattr(_TestState, "saved_data")


def record_test_database(sender: Any, using: str = "default", **kwargs: Any) -> None:
    """``post_migrate`` receiver: remember the database the test runner just migrated.

    Only a database named as the test runner names the ones it creates
    (``TEST["NAME"]``, or ``test_`` and the live name): a no-op ``migrate`` of
    the live database in a process that had called ``setup_test_environment()``
    made it flushable (#35).
    """
    if test_environment_active() and _named_as_a_test_database(using):
        _created.add(str(connections[using].settings_dict["NAME"]))


def _named_as_a_test_database(using: str) -> bool:
    from django.db.backends.base.creation import TEST_DATABASE_PREFIX

    settings = connections[using].settings_dict
    name = str(settings["NAME"])
    return name == (settings.get("TEST") or {}).get("NAME") or name.startswith(TEST_DATABASE_PREFIX)


def created_by_test_runner(using: str) -> bool:
    """Whether the database behind alias ``using`` is one the test runner created."""
    if not test_environment_active():
        return False
    name = str(connections[using].settings_dict["NAME"])
    return any(
        name == created or re.fullmatch(re.escape(created) + r"_\d+", name) for created in _created
    )


def release_before_drop(sender: Any, connection: Any, **kwargs: Any) -> None:
    """``connection_created`` receiver: close the result listener before the test
    runner, on a connection to no database, drops (or creates, or clones) a test
    database.

    Outside Django's test environment it does nothing: a production process that
    opens such a connection (``manage.py dbshell`` does not; a host's own
    maintenance code might) keeps its waiters' listener.
    """
    if connection.alias != NO_DB_ALIAS or not test_environment_active():
        return
    from .results import listener

    listener.stop()
