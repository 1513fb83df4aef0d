"""The URL handed to subprocesses names the server Django's settings name (#38)."""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection

from example_project.settings import _database_from_env
from tests.support.database_url import database_url

SETTINGS = [
    {"NAME": "shop", "USER": "app", "PASSWORD": "p@ss/word", "HOST": "db", "PORT": 6432},
    {"NAME": "shop", "USER": "app", "PASSWORD": "", "HOST": "/work/repo/.pgdata", "PORT": ""},
    {"NAME": "shop", "USER": "app", "PASSWORD": "", "HOST": "/run/postgresql", "PORT": "5433"},
    {"NAME": "shop", "USER": "app", "PASSWORD": "", "HOST": "::1", "PORT": "5432"},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=["tcp", "socket", "socket-port", "ipv6"])
def test_the_url_reads_back_as_the_same_settings(settings, monkeypatch):
    monkeypatch.setenv("K2B_URL_UNDER_TEST", database_url(settings))
    parsed = _database_from_env("K2B_URL_UNDER_TEST")
    assert {key: parsed[key] for key in settings} == {
        **settings,
        "PORT": int(settings["PORT"]) if settings["PORT"] else "",
    }


@pytest.mark.django_db
def test_the_url_connects_to_the_server_the_tests_use():
    """With no DATABASE_URL the tests run on the embedded server's unix socket."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_database(), current_setting('port')")
        expected = cursor.fetchone()
    with psycopg.connect(database_url(connection.settings_dict)) as conn:
        assert conn.execute("SELECT current_database(), current_setting('port')").fetchone() == (
            expected
        )
