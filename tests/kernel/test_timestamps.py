"""The kernel reads timestamps through psycopg's C parse, with the values Django's loader gives.

A loader that parsed an offset, a fraction or a year before 1000 otherwise than
Django's would move a run's lease, its wake time or its step clock.
"""

from __future__ import annotations

import datetime as dt

import psycopg
import pytest
from django.db import connection
from django.db.backends.postgresql.psycopg_any import BaseTzLoader
from psycopg.pq import Format

from k2b_workflows.kernel import db, timestamps

_OID = psycopg.postgres.types["timestamptz"].oid
TEXTS = [
    "2026-12-02 21:08:01.123456+00:00",
    "2026-06-30 23:59:59.999999-07:00",
    "2026-01-01 00:00:00+05:30",
    "1999-12-31 23:59:59.500000+14:00",
    "0099-03-01 12:00:00+00:00",
    "2026-03-29 01:30:00.000001+01:00",
]


@pytest.mark.django_db
def test_the_kernel_reads_timestamps_as_django_does():
    with connection.cursor() as cursor:  # Django's loader, on a connection of its own
        cursor.execute("SELECT t::timestamptz::text FROM unnest(%s::text[]) t", [TEXTS])
        server_texts = [text for (text,) in cursor.fetchall()]
    django = connection.connection.adapters.get_loader(_OID, Format.TEXT)
    if not issubclass(django, BaseTzLoader):  # the kernel spoke on this connection first
        django = type("Django", (BaseTzLoader,), {"timezone": django.timezone})
    expected = [django(_OID, connection.connection).load(t.encode()) for t in server_texts]

    rows = db.fetch_statement("default", "SELECT t::timestamptz FROM unnest(%s::text[]) t", [TEXTS])
    got = [value for (value,) in rows]

    assert issubclass(
        connection.connection.adapters.get_loader(_OID, Format.TEXT), timestamps.TzLoader
    )
    assert got == expected == [dt.datetime.fromisoformat(t) for t in TEXTS]
    assert [v.tzinfo for v in got] == [v.tzinfo for v in expected] == [dt.UTC] * len(TEXTS)
