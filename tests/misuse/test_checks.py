"""System checks: PostgreSQL only, pgtrigger installed and effective, sane settings."""

from __future__ import annotations

import pytest
from django.db.utils import ConnectionHandler
from django.test import override_settings

from k2b_workflows import checks


def ids(messages) -> list[str]:
    return [m.id for m in messages]


def test_the_test_settings_pass_every_check():
    assert checks.check_database() == []
    assert checks.check_pgtrigger() == []
    assert checks.check_settings() == []


def test_a_database_that_is_not_postgresql_fails(monkeypatch, tmp_path):
    sqlite = ConnectionHandler(
        {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "x.db")}}
    )
    monkeypatch.setattr(checks, "connections", sqlite)
    assert ids(checks.check_database()) == ["k2b_workflows.E002"]


@override_settings(K2B_WORKFLOWS={"DATABASE": "nowhere"})
def test_a_kernel_database_alias_missing_from_databases_fails():
    assert ids(checks.check_database()) == ["k2b_workflows.E001"]


def test_pgtrigger_missing_from_installed_apps_fails(settings):
    settings.INSTALLED_APPS = [a for a in settings.INSTALLED_APPS if a != "pgtrigger"]
    assert "k2b_workflows.E003" in ids(checks.check_pgtrigger())


@override_settings(PGTRIGGER_MIGRATIONS=False)
def test_pgtrigger_migrations_off_without_install_on_migrate_fails():
    assert ids(checks.check_pgtrigger()) == ["k2b_workflows.E004"]


@override_settings(PGTRIGGER_MODEL_META=False)
def test_pgtrigger_model_meta_off_fails():
    assert ids(checks.check_pgtrigger()) == ["k2b_workflows.E005"]


@pytest.mark.parametrize(
    ("configured", "expected"),
    [
        ([("RUN_LEASE_MS", 1000)], "k2b_workflows.E006"),
        ({"RUN_LEASE_MS": -1}, "k2b_workflows.E007"),
        ({"RUN_MAX_CONSECUTIVE_FAILURES": 0}, "k2b_workflows.E007"),
        ({"POLL_INTERVAL_MS": "fast"}, "k2b_workflows.E007"),
        ({"PURE_ENDS_TOGETHER": 0}, "k2b_workflows.E007"),
        ({"PURE_ENDS_TOGETHER": 65}, "k2b_workflows.E007"),
        ({"RETRY_BACKOFF_MS": 1000, "RETRY_BACKOFF_MAX_MS": 10}, "k2b_workflows.E008"),
        ({"RUN_LEASE_MS": 100}, "k2b_workflows.W002"),
        ({"LEASE": 1000}, "k2b_workflows.W001"),
    ],
)
def test_bad_settings_values_are_reported(configured, expected):
    with override_settings(K2B_WORKFLOWS=configured):
        assert expected in ids(checks.check_settings())


@pytest.mark.parametrize("together", [1, 8, 64])
def test_pure_ends_together_up_to_its_bound_passes(together):
    with override_settings(K2B_WORKFLOWS={"PURE_ENDS_TOGETHER": together}):
        assert ids(checks.check_settings()) == []


# The isolation level (#38) ----------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_read_committed_passes_the_isolation_check():
    assert checks.check_isolation_level(databases=["default"]) == []
    assert checks.check_isolation_level(databases=None) == []  # plain `check`: not asked


@pytest.mark.django_db(transaction=True)
def test_repeatable_read_on_djangos_connection_is_a_warning_naming_the_level():
    """OPTIONS["isolation_level"], or a session default: what Django's transactions run at."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    try:
        (warning,) = checks.check_isolation_level(databases=["default"])
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED"
            )
    assert warning.id == "k2b_workflows.W005"
    assert "'default'" in warning.msg and "repeatable read" in warning.msg
    assert "Django's connection" in warning.msg


@pytest.mark.django_db(transaction=True)
def test_a_server_default_of_serializable_is_a_warning_for_the_kernels_own_connections():
    """The lease keeper and the heartbeat run in autocommit: the server's default applies."""
    from django.db import connection
    from psycopg import sql

    name = connection.settings_dict["NAME"]
    alter = "ALTER DATABASE {} SET default_transaction_isolation = 'serializable'"
    with connection.cursor() as cursor:
        cursor.execute(sql.SQL(alter).format(sql.Identifier(name)).as_string(cursor.connection))
    try:
        (warning,) = checks.check_isolation_level(databases=["default"])
    finally:
        reset = "ALTER DATABASE {} RESET default_transaction_isolation"
        with connection.cursor() as cursor:
            cursor.execute(sql.SQL(reset).format(sql.Identifier(name)).as_string(cursor.connection))
    assert warning.id == "k2b_workflows.W005"
    assert "serializable" in warning.msg and "own connections" in warning.msg
