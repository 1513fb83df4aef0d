"""The fleet in the admin: each worker process, whether it still beats, and what it runs.

A worker is alive only while its heartbeat is fresh (``WORKER_LOST_AFTER_MS``):
the row's ``state`` says what the worker last wrote, and a SIGKILLed worker
wrote nothing, so the page judges the heartbeat's age itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join

from .. import settings
from ..kernel import clock
from ..lazy import LazyModule
from ..models import RunStatus, WorkerRecord, WorkflowRun
from .common import ReadOnlyMixin

if TYPE_CHECKING:
    from . import display as admin_display
    from . import views as admin_views
else:
    # Only requests use these: a worker process imports this module and never them.
    admin_display = LazyModule("k2b_workflows.admin.display")
    admin_views = LazyModule("k2b_workflows.admin.views")


#: A row "alive" whose heartbeat is no longer fresh: not counted live, not yet lost.
LATE = "late"


def effective_worker_state(worker: WorkerRecord) -> str:
    """A row still "alive" whose heartbeat is too old belongs to a dead process: say lost.

    Between the two, "late": ``workflowstatus`` and the overview no longer count
    it live (``settings.worker_fresh_ms()``), and this page says so rather than
    "alive" (#38).
    """
    if worker.state == WorkerRecord.State.ALIVE:
        silent_ms = (clock.now() - worker.heartbeat_at).total_seconds() * 1000
        if silent_ms > settings.worker_lost_after_ms():
            return WorkerRecord.State.LOST
        if silent_ms > settings.worker_fresh_ms():
            return LATE
    return worker.state


def worker_state_badge(worker: WorkerRecord) -> str:
    state = effective_worker_state(worker)
    return format_html('<span class="k2b-badge k2b-worker-{}">{}</span>', state, state)


@admin.register(WorkerRecord)
class WorkerRecordAdmin(ReadOnlyMixin, admin.ModelAdmin):
    """The fleet: one row per worker process, written only by the workers themselves."""

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> WorkerRecord | None:
        # A worker id is text: one with a NUL, which PostgreSQL refuses in a query,
        # names no worker (the admin's "does not exist"), not a server error.
        if "\x00" in object_id:
            return None
        return super().get_object(request, object_id, from_field)

    list_display = (
        "worker_id",
        "state_badge",
        "host",
        "pid",
        "busy",
        "heartbeat_age",
        "uptime",
        "apps_column",
        "workflows_count",
    )
    list_filter = ("state", "host")
    search_fields = ("worker_id", "host")
    search_help_text = "Worker id or host."
    list_per_page = 100
    fields = (
        "worker_id",
        "state_badge",
        "host",
        "pid",
        "started_at",
        "heartbeat_at",
        "stopped_at",
        "concurrency",
        "in_flight",
        "apps_column",
        "workflows_column",
        "running_runs",
    )
    readonly_fields = fields

    class Media:
        css = {"all": ["k2b_workflows/admin.css"]}

    @admin.display(description="state", ordering="state")
    def state_badge(self, worker: WorkerRecord) -> str:
        return worker_state_badge(worker)

    @admin.display(description="busy")
    def busy(self, worker: WorkerRecord) -> str:
        return f"{worker.in_flight}/{worker.concurrency}"

    @admin.display(description="last heartbeat", ordering="-heartbeat_at")
    def heartbeat_age(self, worker: WorkerRecord) -> str:
        return f"{admin_display.format_duration(clock.now() - worker.heartbeat_at)} ago"

    @admin.display(description="up", ordering="started_at")
    def uptime(self, worker: WorkerRecord) -> str:
        end = worker.heartbeat_at if worker.state != WorkerRecord.State.ALIVE else clock.now()
        return admin_display.format_duration(end - worker.started_at)

    @admin.display(description="apps")
    def apps_column(self, worker: WorkerRecord) -> str:
        return ", ".join(worker.apps) if worker.apps else "all"

    @admin.display(description="workflows")
    def workflows_count(self, worker: WorkerRecord) -> str:
        """A count in the list (a worker may know hundreds); each one on hover and on its page."""
        names = ", ".join(f"{w['name']} v{w['version']}" for w in worker.workflows)
        return format_html('<span title="{}">{}</span>', names, len(worker.workflows))

    @admin.display(description="workflows")
    def workflows_column(self, worker: WorkerRecord) -> str:
        return format_html_join(
            ", ", "<code>{}</code>&nbsp;v{}", ((w["name"], w["version"]) for w in worker.workflows)
        )

    @admin.display(description="runs it holds")
    def running_runs(self, worker: WorkerRecord) -> str:
        runs = WorkflowRun.objects.filter(status=RunStatus.RUNNING, claimed_by=worker.worker_id)
        links = format_html_join(
            ", ",
            '<a href="{}">{}</a>',
            ((admin_views.run_url(r.pk), r.pk) for r in runs.only("id")[:50]),
        )
        return links or "—"
