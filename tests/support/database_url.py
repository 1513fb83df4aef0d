"""A ``DATABASE_URL`` for a subprocess, built from the settings of Django's connection.

The failure it is built around (#38): ``make test`` with no ``DATABASE_URL`` runs on
the embedded PostgreSQL, whose ``HOST`` is a unix-socket directory. A URL written as
``postgres://user@{HOST}:{PORT}/name`` then puts a path where a host name goes, and
the subprocess's ``migrate`` cannot connect. libpq's form for a socket puts the
directory in the ``host`` query parameter, where django-environ and psycopg read it
(``example_project.settings`` moves it back to ``HOST``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode


def database_url(
    settings: Mapping[str, Any], *, name: str | None = None, user: str | None = None
) -> str:
    """The URL of ``settings``' server, for database ``name`` (default: the settings')
    as ``user`` (default: the settings'), with the password only when the user is
    the settings' own."""
    own_user = user is None
    user = (settings["USER"] or "") if user is None else user
    credentials = quote(user, safe="")
    if own_user and settings.get("PASSWORD"):
        credentials += ":" + quote(str(settings["PASSWORD"]), safe="")
    path = quote(str(name if name is not None else settings["NAME"]), safe="")
    host = str(settings.get("HOST") or "")
    port = str(settings.get("PORT") or "")
    if host.startswith("/"):
        query = {"host": host, **({"port": port} if port else {})}
        return f"postgresql://{credentials}@/{path}?{urlencode(query, safe='/')}"
    host = host or "127.0.0.1"
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"postgresql://{credentials}@{host}:{port or 5432}/{path}"
