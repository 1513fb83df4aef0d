"""Attacks by the app's own runtime role on the database side of the evidence (#30).

Every test connects as a fresh role holding exactly what ``grantworkflows``
grants (``tests/support/runtime_role.py``) and tries what a SQL injection in the host
app could: shadow a catalog with a temporary table so that the owner-only
ignore check reads the attacker's rows, then switch the run table's triggers
off and reopen a succeeded run that charged a card.
"""

from __future__ import annotations

import pgtrigger
import pytest
from django.db import DatabaseError, connection, connections, transaction

from k2b_workflows import start_workflow_run
from k2b_workflows.kernel import db
from k2b_workflows.models import WorkflowRun
from k2b_workflows.testing import run_until_idle
from k2b_workflows.triggers import PINNED_SEARCH_PATH
from tests.models import ProviderCall
from tests.support import runtime_role
from tests.support.runtime_role import RUNTIME

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", RUNTIME])

runtime = runtime_role.runtime

#: Catalogs the app's functions (or PostgreSQL on their behalf) could be made to read.
SHADOWED_CATALOGS = {
    "pg_class": "oid oid, relowner oid, relname name",
    "pg_roles": "oid oid, rolname name, rolsuper bool",
    "pg_authid": "oid oid, rolname name, rolsuper bool",
    "pg_auth_members": "roleid oid, member oid",
    "pg_namespace": "oid oid, nspname name",
    "pg_trigger": "oid oid, tgname name",
    "pg_proc": "oid oid, proname name",
    "pg_settings": "name text, setting text",
}


def _trigger_ids() -> str:
    ids = [
        trigger.get_pgid(model)
        for model, trigger in pgtrigger.registered()
        if model._meta.app_label == "k2b_workflows"
    ]
    return "{" + ",".join(ids) + "}"


@pytest.fixture
def charged(runtime) -> WorkflowRun:
    run = start_workflow_run("test.charge", {"amount": 5000})
    run_until_idle(using=RUNTIME)
    run.refresh_from_db()
    assert run.status == "succeeded"
    assert ProviderCall.objects.filter(action="test.charge").count() == 1
    return run


@pytest.mark.parametrize("search_path", [None, "pg_temp, pg_catalog, public"])
def test_a_temporary_pg_class_does_not_let_the_runtime_role_reopen_a_finished_run(
    charged, search_path
):
    """The review's attack, verbatim: with its own ``pg_class`` first on the path, the
    runtime role made itself the owner of ``k2b_run`` in the eyes of the ignore check."""
    with (
        pytest.raises(DatabaseError) as caught,
        transaction.atomic(using=RUNTIME),
        connections[RUNTIME].cursor() as cursor,
    ):
        if search_path:
            cursor.execute(f"SET LOCAL search_path = {search_path}")
        cursor.execute("CREATE TEMP TABLE pg_class (oid oid, relowner oid) ON COMMIT DROP")
        cursor.execute(
            "INSERT INTO pg_class VALUES ('public.k2b_run'::regclass, "
            "(SELECT oid FROM pg_catalog.pg_roles WHERE rolname = current_user))"
        )
        cursor.execute("SELECT set_config('pgtrigger.ignore', %s, true)", [_trigger_ids()])
        cursor.execute(
            "UPDATE public.k2b_run SET status = 'queued', generation = 0 WHERE id = %s",
            [charged.pk],
        )
    assert db.sqlstate(caught.value) == "42501", caught.value
    run_until_idle(using=RUNTIME)
    charged.refresh_from_db()
    assert (charged.status, charged.generation > 0) == ("succeeded", True)
    assert ProviderCall.objects.filter(action="test.charge").count() == 1


@pytest.mark.parametrize("catalog", sorted(SHADOWED_CATALOGS))
def test_no_shadowed_catalog_switches_off_a_trigger(charged, catalog):
    with (
        pytest.raises(DatabaseError) as caught,
        transaction.atomic(using=RUNTIME),
        connections[RUNTIME].cursor() as cursor,
    ):
        cursor.execute("SET LOCAL search_path = pg_temp, pg_catalog, public")
        cursor.execute(f"CREATE TEMP TABLE {catalog} ({SHADOWED_CATALOGS[catalog]})")
        cursor.execute("SELECT set_config('pgtrigger.ignore', %s, true)", [_trigger_ids()])
        cursor.execute("UPDATE public.k2b_run SET generation = 0 WHERE id = %s", [charged.pk])
    assert db.sqlstate(caught.value) == "42501", caught.value
    charged.refresh_from_db()
    assert charged.generation > 0


def _app_functions() -> list[tuple[str, str, list[str] | None]]:
    """Every function in the schema of the app's tables: the app's and pgtrigger's."""
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT n.nspname, p.proname, p.proconfig
                 FROM pg_catalog.pg_proc p
                 JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
                WHERE n.oid = (SELECT relnamespace FROM pg_catalog.pg_class
                                WHERE oid = 'k2b_run'::regclass)
                ORDER BY 2"""
        )
        return cursor.fetchall()


def test_every_function_of_the_app_runs_with_a_fixed_search_path():
    functions = _app_functions()
    names = {name for _, name, _ in functions}
    assert {"k2b_now", "_k2b_refuse_foreign_ignore", "_pgtrigger_should_ignore"} <= names
    assert sum(name.startswith("pgtrigger_") for name in names) >= 10
    unpinned = [
        f"{schema}.{name}: {config}"
        for schema, name, config in functions
        if f"search_path={PINNED_SEARCH_PATH}" not in (config or [])
    ]
    assert unpinned == []


def test_the_pinned_functions_still_work_for_the_owner():
    """The owner's ``pgtrigger.ignore`` (how ``purgeworkflows`` deletes) still passes the check."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT k2b_now() IS NOT NULL")
        assert cursor.fetchone() == (True,)
        cursor.execute("SELECT \"public\"._k2b_refuse_foreign_ignore('x', 'k2b_run'::regclass)")
        assert cursor.fetchone() == (True,)
