"""Fixtures of the hot-path tests: a connection that prepares its statements or does
not, and one whose Django cursors bind on the server."""

from __future__ import annotations

import os

import pytest
from django.db import connection

# The hot.* workflows, registered for every test of this directory.
from tests.hot_path import workflows  # noqa: F401


@pytest.fixture(params=["prepared", "unprepared"])
def prepares(request):
    """The connection with psycopg preparing statements from their first run, or never
    (``prepare_threshold`` None, Django's default): the kernel's batched transactions
    are pipelines of prepared statements in the first case, multi-statement strings
    in the second. A new connection: nothing is prepared on it yet."""
    if request.param == "prepared" and os.environ.get("K2B_TEST_POOL_MODE") == "transaction":
        pytest.skip(
            "through a transaction-pooling PgBouncer before 1.21 nothing may be prepared "
            "(docs/operations.md#pgbouncer): prepare_threshold is None"
        )
    connection.close()
    connection.ensure_connection()
    before = connection.connection.prepare_threshold
    connection.connection.prepare_threshold = 0 if request.param == "prepared" else None
    yield request.param == "prepared"
    connection.connection.prepare_threshold = before


@pytest.fixture
def server_side_binding():
    """Django's connection with ``OPTIONS["server_side_binding"]``: its cursors bind
    parameters on the server (``ServerBindingCursor``). A new connection, as ``prepares``."""
    options = connection.settings_dict.setdefault("OPTIONS", {})
    before = options.get("server_side_binding")
    options["server_side_binding"] = True
    connection.close()
    yield
    connection.close()
    if before is None:
        del options["server_side_binding"]
    else:
        options["server_side_binding"] = before
