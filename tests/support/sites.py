"""A new Django site, as a reader sets one up from the docs, on a database of its own.

The docs' tests build a ``startproject`` site beside the suite (from the source
tree, or from the built wheel in a bare venv) and migrate it against the suite's
server. Each built it the same way; a setting added to one and not the other
(a silenced check, a database option) let them drift from getting-started.md.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from django.db import connection

#: What a site adds to the settings ``startproject`` wrote: getting-started.md's,
#: ``{app}`` the site's own app.
SETTINGS = """
INSTALLED_APPS += ["pgtrigger", "k2b_workflows", {app!r}]
DATABASES = {{
    "default": {{
        "ENGINE": "django.db.backends.postgresql",
        "NAME": {name!r},
        "USER": {user!r},
        "PASSWORD": {password!r},
        "HOST": {host!r},
        "PORT": {port!r},
    }}
}}
SILENCED_SYSTEM_CHECKS = ["k2b_workflows.W003"]   # one role for owner and runtime here
"""


def database_name(kind: str) -> str:
    """The site's database: named after the suite's and its xdist worker, never a developer's."""
    base = connection.settings_dict["NAME"]
    return f"{base}_{kind}{os.environ.get('PYTEST_XDIST_WORKER', '')}"[:50]


def start_project(
    django_admin: Path, project: str, path: Path, *, app: str, database: str, settings: str = ""
) -> Path:
    """``django-admin startproject`` into ``path``, with an empty ``app`` package and the
    settings of getting-started.md (and ``settings``) added; returns the app's folder."""
    subprocess.run(
        [str(django_admin), "startproject", project, str(path)], check=True, capture_output=True
    )
    package = path / app
    package.mkdir()
    (package / "__init__.py").write_text("")
    ours = connection.settings_dict
    with (path / project / "settings.py").open("a") as fh:
        fh.write(
            SETTINGS.format(
                app=app,
                name=database,
                user=ours["USER"] or "",
                password=ours["PASSWORD"] or "",
                host=ours["HOST"] or "",
                port=str(ours["PORT"] or ""),
            )
            + settings
        )
    return package


def site_env(*, drop_prefixes: tuple[str, ...] = (), drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment without the suite's own settings: the site has its own."""
    prefixes = ("DJANGO_", "K2B_", "PYTEST_", *drop_prefixes)
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(prefixes) and key not in ("DATABASE_URL", *drop)
    }


def connect(dbname: str) -> psycopg.Connection:
    """A connection of the suite's own role to ``dbname``, outside Django's test database."""
    settings = connection.settings_dict
    return psycopg.connect(
        dbname=dbname,
        user=settings["USER"],
        password=settings["PASSWORD"] or None,
        host=settings["HOST"],
        port=settings["PORT"],
        autocommit=True,
    )


@contextmanager
def fresh_database(name: str, *, also_drop: Callable[[], list[str]] = list) -> Iterator[str]:
    """An empty database ``name`` for the site, dropped afterwards with those ``also_drop``
    names then (the site's own test databases)."""
    with connect("postgres") as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with connect("postgres") as conn:
            for left in [name, *also_drop()]:
                conn.execute(f'DROP DATABASE IF EXISTS "{left}" WITH (FORCE)')
