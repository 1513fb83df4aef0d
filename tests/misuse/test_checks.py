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
        ({"RETRY_BACKOFF_MS": 1000, "RETRY_BACKOFF_MAX_MS": 10}, "k2b_workflows.E008"),
        ({"RUN_LEASE_MS": 100}, "k2b_workflows.W002"),
        ({"LEASE": 1000}, "k2b_workflows.W001"),
    ],
)
def test_bad_settings_values_are_reported(configured, expected):
    with override_settings(K2B_WORKFLOWS=configured):
        assert expected in ids(checks.check_settings())
