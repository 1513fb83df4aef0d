"""Failed runs grouped by what failed them and the hour they failed in (#49).

What an operator asks first during an incident is "what is failing, since
when, how much": the admin's Failures page answers it with one row per
workflow or task, exception class (a task's) or error code (a workflow's), and
hour. The read is bounded however many runs there are: the failures of the
last ``hours`` are walked newest first through ``k2b_run_finished`` and at most
``SCAN_CAP`` of them are grouped (the page then says "at least"). A task
call's exception class is that of its last failed attempt the worker wrote
(``tasks.runs.sealed_attempts``): a row the database's runtime role inserted
is not counted.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass

from django.utils import timezone

from . import naming, settings
from .lazy import LazyModule
from .models import RunStatus, TaskAttempt, WorkflowRun

task_runs = LazyModule("k2b_workflows.tasks.runs")

#: The most failed runs one read groups; past it the counts are "at least".
SCAN_CAP = 2_000
#: The window shown when none is asked for, and the longest one may ask for.
DEFAULT_HOURS = 24
MAX_HOURS = 24 * 7


@dataclass(frozen=True)
class FailureGroup:
    """The runs of one workflow or task that failed the same way in one hour."""

    workflow_name: str
    task_path: str
    #: A task's exception class path, or a workflow run's error code.
    kind: str
    #: Whether ``kind`` is an exception class (a task's attempt) or an error code.
    is_exception: bool
    hour: dt.datetime
    count: int

    @property
    def name(self) -> str:
        return naming.display_name(self.workflow_name, self.task_path)


@dataclass(frozen=True)
class Failures:
    groups: list[FailureGroup]
    #: The failed runs grouped (at most ``SCAN_CAP``).
    scanned: int
    #: More failed runs than ``SCAN_CAP`` in the window: the oldest are not counted.
    capped: bool
    since: dt.datetime


def read(hours: int = DEFAULT_HOURS) -> Failures:
    """The failed runs of the last ``hours`` (1 to ``MAX_HOURS``), grouped, newest hour first."""
    since = timezone.now() - dt.timedelta(hours=max(1, min(hours, MAX_HOURS)))
    rows = list(
        WorkflowRun.objects.using(settings.database())
        .filter(finished_at__gte=since, status=RunStatus.FAILED)
        .order_by("-finished_at")
        .values_list("id", "workflow_name", "task_path", "error_code", "finished_at")[
            : SCAN_CAP + 1
        ]
    )
    capped = len(rows) > SCAN_CAP
    rows = rows[:SCAN_CAP]
    raised = _last_exceptions([r[0] for r in rows if naming.is_task_workflow(r[1])])
    counts: Counter[tuple[str, str, str, bool, dt.datetime]] = Counter()
    for run_id, workflow_name, task_path, error_code, finished_at in rows:
        if finished_at is None:  # filtered out above; the column is nullable
            continue
        exception = raised.get(run_id)
        hour = finished_at.replace(minute=0, second=0, microsecond=0)
        kind = exception or error_code or "(no error code)"
        counts[(workflow_name, task_path, kind, exception is not None, hour)] += 1
    groups = [
        FailureGroup(name, path, kind, is_exception, hour, count)
        for (name, path, kind, is_exception, hour), count in counts.items()
    ]
    groups.sort(key=lambda g: (g.hour, g.count), reverse=True)
    return Failures(groups=groups, scanned=len(rows), capped=capped, since=since)


def _last_exceptions(run_ids: list) -> dict:
    """Run id -> the exception class path of its last attempt the worker wrote."""
    by_run: dict = {}
    attempts = TaskAttempt.objects.using(settings.database()).filter(run_id__in=run_ids)
    for row in attempts.order_by("run_id", "id"):
        by_run.setdefault(row.run_id, []).append(row)
    last = {}
    for run_id, rows in by_run.items():
        kept = task_runs.sealed_attempts(run_id, rows)
        if kept:
            last[run_id] = kept[-1].exception_class_path
    return last
