"""Timestamps read by the kernel's statements, parsed by psycopg's C code.

The cost this is built around: Django loads every ``timestamptz`` through a
loader of its own (``BaseTzLoader``, to label each value with the
connection's time zone), a subclass of psycopg's pure-Python loader, so each
value is parsed in Python even where psycopg's C loader is installed: about
13 µs a value against 4, and a claim's preload reads nine of them per run,
besides what the run's statements return. The loader here gives the same
values (the C loader's parse, labeled with Django's time zone, as Django's
loader does) and is installed on a connection the first time the kernel
sends a statement on it (``db.statement_cursor``).
"""

from __future__ import annotations

import datetime
from typing import Any

import psycopg
from psycopg.adapt import Loader
from psycopg.pq import Format

_OID = psycopg.postgres.types["timestamptz"].oid
#: psycopg's own text loader for ``timestamptz``: its C class when psycopg's
#: binary package is installed (and then not a class Python can subclass).
_PARSER: Any = psycopg.adapters.get_loader(_OID, Format.TEXT)


def _django_loader() -> type | None:
    try:
        from django.db.backends.postgresql.psycopg_any import BaseTzLoader
    except ImportError:  # psycopg2: Django's loader is not in play
        return None
    return BaseTzLoader


_DJANGO = _django_loader()


class TzLoader(Loader):
    """psycopg's parse of a ``timestamptz``, labeled with ``timezone`` (Django's)."""

    timezone: datetime.tzinfo | None = None

    def __init__(self, oid: int, context: Any = None) -> None:
        super().__init__(oid, context)
        self._parse = _PARSER(oid, context).load

    def load(self, data: Any) -> datetime.datetime:
        return self._parse(data).replace(tzinfo=self.timezone)


def install(conn: psycopg.Connection) -> bool:
    """Put a ``TzLoader`` where Django registered its own on ``conn``; nothing else.
    Returns whether it did: a transformer made before has Django's loader.

    Checked at every statement (a dictionary look-up): Django registers its
    loader again when the connection's time zone is set anew.
    """
    if _DJANGO is None or _PARSER is None:
        return False
    current: Any = conn.adapters.get_loader(_OID, Format.TEXT)
    if current is None or not issubclass(current, _DJANGO):
        return False

    class Specific(TzLoader):
        timezone = current.timezone

    conn.adapters.register_loader(_OID, Specific)
    return True
