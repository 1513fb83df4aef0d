"""Insert a dedup row once, safely, on a table with several unique constraints.

The obvious ``INSERT ... ON CONFLICT (key) DO NOTHING`` fails with a unique
violation whenever another row holds one of the *other* constraints, and even
identical concurrent rows sometimes collide. Inserting with ``ON CONFLICT DO
NOTHING`` and no conflict target, then reading the row by its key, never
raises (measured: 0 errors in 1,200 races) and tells every case apart.
"""

from __future__ import annotations

import datetime as dt
import functools
import uuid
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
    ``None`` as ``None`` (asked once, ``_plan``): a task run has some twenty
    NULL columns, each a few calls deep into Django on every enqueue (#37).

    A column of a plain field (``_plain``) whose value is of the type the field
    stores is taken as Django's own path would leave it, without that path: a
    ``str`` of a ``CharField`` as it is, an ``int`` of an ``IntegerField``
    through the backend's ``adapt_integerfield_value`` as Django's last step.
    Some forty such columns a run, each half a dozen calls deep into Django,
    were a fifth of an enqueue's CPU (#52). Any other value, a field of another
    class (a subclass too), ``auto_now``: Django's ``pre_save`` and
    ``get_db_prep_save``.
    """
    values = []
    adapt_int = connection.ops.adapt_integerfield_value
    for field, attname, plain, null_kept in _plan(type(obj), connection):
        if plain is None:
            value = field.pre_save(obj, add=True)
        else:
            value = getattr(obj, attname)
            kind = type(value)
            if kind is plain[0]:
                if plain[1] is None:
                    if kind is not dt.datetime or value.tzinfo is not None:
                        values.append(value)
                        continue
                else:
                    values.append(adapt_int(value, plain[1]))
                    continue
        if value is not None or not null_kept:
            value = field.get_db_prep_save(value, connection)
        values.append(value)
    return values


#: A plain field's stored type, and for an integer its internal type (None: as is).
_Plain = tuple[type, str | None]
#: Model -> each of its ``insert_fields``: (field, attname, its ``_plain`` or None,
#: whether it prepares ``None`` as ``None``).
_PLANS: dict[type[models.Model], tuple[tuple[Any, str, _Plain | None, bool], ...]] = {}
_AS_IS: dict[type[models.Field], type] = {
    models.CharField: str,
    models.TextField: str,
    models.BooleanField: bool,
    models.UUIDField: uuid.UUID,
}
_INTEGERS = (
    models.IntegerField,
    models.BigIntegerField,
    models.SmallIntegerField,
    models.PositiveIntegerField,
    models.PositiveBigIntegerField,
    models.PositiveSmallIntegerField,
)


def _plan(model: type[models.Model], connection: Any) -> tuple[Any, ...]:
    plan = _PLANS.get(model)
    if plan is None:
        fields = insert_fields(model)
        plan = _PLANS[model] = tuple(
            (f, f.attname, _plain(f, connection), f.get_db_prep_save(None, connection) is None)
            for f in fields
        )
    return plan


def _plain(field: Any, connection: Any) -> _Plain | None:
    """The type of value ``field`` saves unchanged (an ``int``: adapted as its
    ``IntegerField.get_db_prep_value`` ends), when its ``pre_save`` reads the
    attribute: exact Django field classes only, whose code is known. None: ask
    Django. Only where the backend keeps UUIDs and datetimes as they are
    (PostgreSQL's)."""
    kind = type(field)
    if kind in (models.ForeignKey, models.OneToOneField):
        if type(field.target_field) is not models.UUIDField:
            return None
        kind = models.UUIDField  # saved as its target's value
    if kind in _AS_IS:
        if kind is models.UUIDField and not connection.features.has_native_uuid_field:
            return None
        return (_AS_IS[kind], None)
    if kind is models.DateTimeField:
        if field.auto_now or field.auto_now_add:
            return None
        if connection.ops.adapt_datetimefield_value(_PROBE) is not _PROBE:
            return None
        return (dt.datetime, None)  # an aware one (a naive one: Django warns, makes it aware)
    if kind in _INTEGERS:
        return (int, field.get_internal_type())
    return None


_PROBE = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
