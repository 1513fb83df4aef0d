"""A database alias connected as a fresh runtime role, as ``grantworkflows`` sets it up.

Tests of what the runtime role can and cannot do use it: a real role is
created in the test cluster (unique name, dropped afterwards), given exactly
what ``manage.py grantworkflows`` grants plus what a host app grants for its
own models, and the kernel itself runs through it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from django.apps import apps
from django.conf import settings
from django.db import DatabaseError, connection, connections, transaction
from django.test import override_settings

from k2b_workflows.kernel import db
from k2b_workflows.roles import apply_grants, owned_sequences

RUNTIME = "k2b_runtime"

# A second alias onto the test database (a mirror: never created, never flushed),
# declared before the tests are set up so that they may use it; its USER is set
# to a fresh role by the fixture.
connections.settings.setdefault(
    RUNTIME, {**connections.settings["default"], "TEST": {"MIRROR": "default"}}
)


@pytest.fixture
def runtime() -> Iterator[str]:
    """An alias connected as a fresh runtime role holding only the documented grants."""
    role = f"k2b_rt_{uuid.uuid4().hex[:12]}"
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE ROLE "{role}" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE')
        apply_grants(role, "default")
        # The test app's own tables (what a host app grants for its models).
        tables = [m._meta.db_table for m in apps.get_app_config("tests").get_models()]
        for table in tables:
            cursor.execute(f'GRANT SELECT, INSERT, UPDATE, DELETE ON "{table}" TO "{role}"')
        for sequence in owned_sequences("default", tables):
            cursor.execute(f'GRANT USAGE ON SEQUENCE {sequence} TO "{role}"')
    connections[RUNTIME].close()
    connections[RUNTIME].settings_dict.update(
        NAME=connections["default"].settings_dict["NAME"], USER=role, PASSWORD=""
    )
    try:
        with override_settings(K2B_WORKFLOWS={**settings.K2B_WORKFLOWS, "DATABASE": RUNTIME}):
            yield role
    finally:
        connections[RUNTIME].close()
        with connection.cursor() as cursor:
            cursor.execute(f'DROP OWNED BY "{role}"')
            cursor.execute(f'DROP ROLE "{role}"')


AUDITOR = "k2b_auditor"
# A mirror of the test database too, whose USER the fixture sets to a role that
# may only read.
connections.settings.setdefault(
    AUDITOR, {**connections.settings["default"], "TEST": {"MIRROR": "default"}}
)


@pytest.fixture
def auditor():
    """An alias connected as a role that may only read the app's tables."""
    role = f"k2b_ro_{uuid.uuid4().hex[:12]}"
    alias = AUDITOR
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE ROLE "{role}" LOGIN NOSUPERUSER')
        cursor.execute(f'GRANT USAGE ON SCHEMA public TO "{role}"')
        cursor.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA public TO "{role}"')
    connections[alias].close()
    connections[alias].settings_dict.update(
        NAME=connections["default"].settings_dict["NAME"], USER=role, PASSWORD=""
    )
    try:
        yield alias
    finally:
        connections[alias].close()
        with connection.cursor() as cursor:
            cursor.execute(f'DROP OWNED BY "{role}"')
            cursor.execute(f'DROP ROLE "{role}"')


def as_runtime(sql: str, params: list | None = None) -> None:
    """Run one statement as the runtime role, in a transaction of its own."""
    with transaction.atomic(using=RUNTIME), connections[RUNTIME].cursor() as cursor:
        cursor.execute(sql, params or [])


def refused(sql: str, params: list | None = None) -> None:
    """The statement fails as the runtime role with ``insufficient_privilege`` (42501)."""
    with pytest.raises(DatabaseError) as caught:
        as_runtime(sql, params)
    assert db.sqlstate(caught.value) == "42501", caught.value
