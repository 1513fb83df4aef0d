"""The runs list's filters by workflow, by task and by queue (#51), and by batch (#50).

A django.tasks call is a run of one of three workflows (``k2b.task.<effect>``),
which says nothing of the task: filtering by workflow offered those three and
no task. The filter by task lists the task paths runs carry, and the filter
by queue the queues; both lists are read in one index descent per value
(a "loose index scan": ``k2b_run_task_path``, ``k2b_run_queue_status``), at most
``MAX_CHOICES`` of them, never a scan of a table that may hold a million runs.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from django.contrib import admin
from django.db import connections
from django.db.models import QuerySet
from django.db.models.fields.json import KeyTextTransform
from django.http import HttpRequest

from .. import naming, queues, settings

#: The most task paths (or queues) a filter lists, first by name; a path past it
#: is still filtered on when a link or the search names it.
MAX_CHOICES = queues.MAX_QUEUES

#: The task paths runs carry, in order, one descent of ``k2b_run_task_path`` each.
_TASK_PATHS_SQL = """
WITH RECURSIVE t(path, n) AS (
    (SELECT task_path, 1 FROM k2b_run WHERE task_path <> '' ORDER BY task_path LIMIT 1)
  UNION ALL
    SELECT (SELECT r.task_path FROM k2b_run r
             WHERE r.task_path <> '' AND r.task_path > t.path
             ORDER BY r.task_path LIMIT 1),
           t.n + 1
      FROM t
     WHERE t.path IS NOT NULL AND t.n < %s
)
SELECT path FROM t WHERE path IS NOT NULL
"""

#: The statements of the filters, for the test that reads their plans.
STATEMENTS = {"task_paths": _TASK_PATHS_SQL}


def task_paths(using: str | None = None, limit: int = MAX_CHOICES) -> list[str]:
    """The task paths of the runs (up to ``limit``), by name."""
    with connections[using or settings.database()].cursor() as cursor:
        cursor.execute(_TASK_PATHS_SQL, [limit])
        return [row[0] for row in cursor.fetchall()]


class WorkflowFilter(admin.AllValuesFieldListFilter):
    """The workflows, a task workflow named for what it holds: every task of its effect.

    Its runs are found by task in ``TaskFilter``; here ``k2b.task.external``
    would read as a workflow of that name.
    """

    def choices(self, changelist: Any) -> Iterator[Any]:
        for choice in super().choices(changelist):
            effect = naming.EFFECT_OF_WORKFLOW.get(str(choice["display"]))
            if effect is not None:
                choice["display"] = f"every {effect} task"
            yield choice


class TaskFilter(admin.SimpleListFilter):
    """One task's calls, by its path: the filter lists the paths runs carry."""

    title = "task"
    parameter_name = "task"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(path, path) for path in task_paths()]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet | None:
        value = self.value()
        return queryset.filter(task_path=value) if value else queryset


class QueueFilter(admin.SimpleListFilter):
    """The runs of one queue (``runworkflows --queue``); workflow runs are on "default"."""

    title = "queue"
    parameter_name = "queue"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(name, name) for name in queues.queue_names(limit=MAX_CHOICES)]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet | None:
        value = self.value()
        return queryset.filter(queue=value) if value else queryset


def batch_members(queryset: QuerySet, batch_id: str) -> QuerySet:
    """The members of batch ``batch_id`` among ``queryset``, through ``k2b_run_batch``
    (its expression and its predicate, so the planner can use it)."""
    return queryset.alias(batch=KeyTextTransform("batch", "input")).filter(
        input__has_key="batch", batch=batch_id
    )


class BatchFilter(admin.SimpleListFilter):
    """The members of one batch (#50), reached from the batch's page: ``?batch=<id>``.

    Not a list of batches to pick from (there may be thousands): the choice shown
    is the batch the link named."""

    title = "batch"
    parameter_name = "batch"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        value = request.GET.get(self.parameter_name)
        if not value:
            return []
        try:
            batch_id = str(uuid.UUID(value))
        except ValueError:
            return []
        return [(batch_id, f"batch {batch_id[:8]}")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet | None:
        value = self.value()
        if not value:
            return queryset
        try:
            batch_id = str(uuid.UUID(value))
        except ValueError:
            return queryset.none()
        return batch_members(queryset, batch_id)
