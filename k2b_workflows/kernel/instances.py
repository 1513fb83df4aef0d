"""Model instances of the hot path, built without ``Model.__init__``.

Why: a claimed run's row (fifty fields), its journal and ledger entries, and
each new step's journal entry were built through ``Model.__init__``
(``from_db``, or keyword arguments), which sets every field through its
descriptor, looks up each keyword among the fields and sends the init
signals: about a tenth of a worker's CPU on a drain of PURE runs
(docs/performance.md). The instances here are the same ones, made by filling
the instance's ``__dict__``: a field's value lives there whatever its
descriptor (a foreign key's ``__set__`` only clears a cached related object,
which a new instance has none of). A model that has init signal receivers, or
values that are not plain fields, go through Django as before.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from django.db import models
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init

M = TypeVar("M", bound=models.Model)


def _signalled(model: type[models.Model]) -> bool:
    """Whether anything listens to the model's init signals (then Django builds it);
    asked of the signals only when they have receivers at all, a cost per instance."""
    if not (pre_init.receivers or post_init.receivers):
        return False
    return pre_init.has_listeners(model) or post_init.has_listeners(model)


def loaded(model: type[M], using: str, attnames: Sequence[str], values: Iterable[Any]) -> M:
    """``model.from_db(using, attnames, values)``, for values already in Python form
    (``attnames``: every concrete field's, in any order)."""
    if _signalled(model):
        return model.from_db(using, list(attnames), list(values))
    instance = model.__new__(model)
    instance.__dict__.update(zip(attnames, values, strict=True))
    state = instance._state = ModelState()
    state.adding = False
    state.db = using
    return instance


@functools.cache
def _defaults(model: type[models.Model]) -> tuple[dict[str, Any], frozenset[str], frozenset[str]]:
    """The model's constant defaults by attname, the fields a caller must give (their
    default is computed, such as ``timezone.now``, or mutable, or the database's),
    and every field's attname."""
    constant: dict[str, Any] = {}
    required = set()
    for field in model._meta.concrete_fields:
        default = field.get_default()
        if (field.has_default() and callable(field.default)) or not isinstance(
            default, str | int | type(None)
        ):
            required.add(field.attname)
        else:
            constant[field.attname] = default
    names = frozenset(f.attname for f in model._meta.concrete_fields)
    return constant, frozenset(required), names


def fresh(model: type[M], values: dict[str, Any]) -> M:
    """``model(**values)``, not saved yet; ``values`` keyed by attname."""
    constant, required, names = _defaults(model)
    if _signalled(model) or not required <= values.keys() or not values.keys() <= names:
        return model(**values)
    instance = model.__new__(model)
    instance.__dict__.update(constant)
    instance.__dict__.update(values)
    instance._state = ModelState()
    return instance
