"""The Queues page: each queue's runs, its line and its throughput, and Pause and Resume (#49).

Reads are bounded however many runs there are (``k2b_workflows/queues.py``).
Pause and Resume are POST forms under the admin's CSRF protection, and need
``k2b_workflows.pause_queue`` beyond seeing runs; both go through
``control.pause_queue`` and ``control.resume_queue``, which write the pause's
row and the admin's history (``LogEntry``) of the queue in one transaction,
as the Schedules page does for a schedule's pause and resume. No script.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.views.decorators.http import require_POST

from .. import control, queues
from ..exceptions import InvalidInput
from ..lazy import LazyModule
from ..models import QueuePause

if TYPE_CHECKING:
    from . import overview_views as admin_overview
    from . import views as admin_views
else:
    # Only requests use these: a worker process imports this module and never them.
    admin_overview = LazyModule("k2b_workflows.admin.overview_views")
    admin_views = LazyModule("k2b_workflows.admin.views")


@admin.register(QueuePause)
class QueuesAdmin(admin.ModelAdmin):
    """The Queues page in place of a list of pause rows; nothing is edited through forms."""

    class Media:
        css = {"all": ["k2b_workflows/admin.css"]}

    def has_module_permission(self, request: HttpRequest) -> bool:
        return admin_views.can_view_runs(request)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return admin_views.can_view_runs(request)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(control.PAUSE_PERMISSION)

    def get_urls(self) -> list:
        wrap = self.admin_site.admin_view
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"
        return [
            path("pause/", wrap(require_POST(self.pause_view)), name=f"{prefix}_pause"),
            path("resume/", wrap(require_POST(self.resume_view)), name=f"{prefix}_resume"),
            *super().get_urls(),
        ]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not admin_views.can_view_runs(request):
            raise PermissionDenied
        views = queues.read()
        context: dict[str, Any] = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "app_label": self.opts.app_label,
            "media": self.media,
            "title": "Queues",
            "rows": [
                {
                    "view": v,
                    "counts": v.shown_counts(),
                    "oldest_ready": admin_overview.age_text(v.oldest_ready_s),
                    "per_minute": f"{v.per_minute:.1f}",
                }
                for v in views
            ],
            "statuses": queues.STATUSES,
            "count_cap": f"{queues.COUNT_CAP:,}",
            "recent_minutes": int(queues.RECENT.total_seconds() // 60),
            "can_pause": self.has_pause_permission(request),
        }
        return TemplateResponse(request, "admin/k2b_workflows/queues.html", context)

    def pause_view(self, request: HttpRequest) -> HttpResponse:
        name = self._name(request)
        reason = request.POST.get("reason", "")
        return self._act(
            request,
            lambda: control.pause_queue(name, reason=reason, actor=request.user),
            done=f"Paused queue {name}.",
            not_done=f"Queue {name} was paused already.",
        )

    def resume_view(self, request: HttpRequest) -> HttpResponse:
        name = self._name(request)
        return self._act(
            request,
            lambda: control.resume_queue(name, actor=request.user),
            done=f"Resumed queue {name}.",
            not_done=f"Queue {name} was not paused.",
        )

    def _act(
        self, request: HttpRequest, change: Callable[[], bool], *, done: str, not_done: str
    ) -> HttpResponse:
        """Pause or resume, say what happened (or what was wrong), back to the page."""
        try:
            if change():
                self.message_user(request, done, messages.SUCCESS)
            else:
                self.message_user(request, not_done, messages.INFO)
        except InvalidInput as exc:
            self.message_user(request, str(exc), messages.ERROR)
        return HttpResponseRedirect(reverse("admin:k2b_workflows_queuepause_changelist"))

    def _name(self, request: HttpRequest) -> str:
        """The queue the form names; the permission is checked before anything is read."""
        if not self.has_pause_permission(request):
            raise PermissionDenied
        return request.POST.get("queue", "")
