"""Batches of task calls in the admin (#50): a batch, its members by state, and its
callbacks' runs.

The page reads the members through the batch's index (``k2b_run_batch``): its
counts by state, and the newest ``MEMBERS_SHOWN`` members; every member is one
click away in the runs list, filtered by the batch.
"""

from __future__ import annotations

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from .. import settings
from ..kernel import batches
from ..models import TaskBatch, WorkflowRun
from .common import ReadOnlyMixin, status_badge
from .filters import batch_members

#: How many members the batch's page lists (newest first).
MEMBERS_SHOWN = 50


def _run_link(run_id: str, label: str) -> str:
    url = reverse("admin:k2b_workflows_workflowrun_change", args=[run_id])
    return format_html('<a href="{}">{}</a>', url, label)


@admin.register(TaskBatch)
class TaskBatchAdmin(ReadOnlyMixin, admin.ModelAdmin):
    """One row per ``enqueue_batch``: read-only, written by the kernel alone."""

    list_display = ("id", "task_path", "total", "created_at", "finished_at", "outcome")
    list_filter = ("outcome",)
    search_fields = ("=id", "task_path")
    list_per_page = 50
    show_full_result_count = False
    fields = (
        "id",
        "task_path",
        "total",
        "created_at",
        "finished_at",
        "outcome",
        "member_counts",
        "callback_links",
        "member_links",
    )
    readonly_fields = fields

    @admin.display(description="members by state")
    def member_counts(self, batch: TaskBatch) -> str:
        counts = batches.counts(settings.database(), batch.pk)
        by_status = counts.by_status if counts is not None else {}
        url = reverse("admin:k2b_workflows_workflowrun_changelist") + f"?batch={batch.pk}"
        listed = format_html_join(
            " ", "{} {}", ((status_badge(s), n) for s, n in sorted(by_status.items()))
        )
        return format_html('{} — <a href="{}">all members</a>', listed or "none", url)

    @admin.display(description="callbacks' runs")
    def callback_links(self, batch: TaskBatch) -> str:
        declared = sorted(batch.callbacks or {})
        runs = batch.callback_runs or {}
        if not declared:
            return "none declared"
        return format_html_join(
            ", ",
            "{}: {}",
            (
                (name, _run_link(runs[name], runs[name][:8]) if name in runs else "not enqueued")
                for name in declared
            ),
        )

    @admin.display(description=f"members (newest {MEMBERS_SHOWN})")
    def member_links(self, batch: TaskBatch) -> str:
        members = batch_members(WorkflowRun.objects.all(), str(batch.pk)).only("id", "status")
        return format_html_join(
            " ",
            "{} {}",
            (
                (_run_link(str(run.pk), str(run.pk)[:8]), status_badge(run.status))
                for run in members[:MEMBERS_SHOWN]
            ),
        )
