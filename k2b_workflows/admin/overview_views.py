"""The admin's overview page: the fleet at a glance, and a chart drawn on the server.

Why the chart is SVG written here: an operators' page that loads a chart
library from a CDN breaks on the networks operators work from (no internet,
a strict Content-Security-Policy) and ships a dependency the app would have
to keep patched. The SVG below is plain markup with numbers and fixed labels
in it, coloured only through CSS classes whose colours are the admin's
variables (``admin.css``), so it follows the admin's light and dark themes.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from .. import failures
from . import overview
from .views import can_view_runs

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin

WIDTH, HEIGHT = 720, 200
LEFT, RIGHT, TOP, BOTTOM = 44, 12, 12, 28
#: (series attribute, CSS class, legend label)
SERIES = (
    ("started_per_minute", "k2b-line-started", "started"),
    ("finished_per_minute", "k2b-line-finished", "finished"),
    ("failed_per_minute", "k2b-line-failed", "failed"),
)


def _ceiling(value: int) -> int:
    """A round top for the y axis at or above ``value`` (1, 2, 5, 10, 20, 50, ...)."""
    decade = 1
    while True:
        for multiple in (1, 2, 5):
            if decade * multiple >= value:
                return decade * multiple
        decade *= 10


def _points(values: list[int], top: int) -> str:
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    n = max(len(values) - 1, 1)
    return " ".join(
        f"{LEFT + inner_w * i / n:.1f},{TOP + inner_h * (1 - v / top):.1f}"
        for i, v in enumerate(values)
    )


def chart_svg(view: overview.Overview) -> SafeString:
    """Started, finished and failed runs per minute over the window, as inline SVG."""
    series = [(getattr(view, attr), css, label) for attr, css, label in SERIES]
    top = _ceiling(max([1, *(max(values, default=0) for values, _, _ in series)]))
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    parts: list[str] = []
    for fraction in (0, 0.5, 1):
        y = TOP + inner_h * (1 - fraction)
        parts.append(
            f'<line class="k2b-grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="k2b-axis" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{int(top * fraction)}</text>"
        )
    # Time labels: every 10 minutes over an hour, every 3 hours over a day.
    every = 10 if view.minutes <= 60 else 180
    for minute in range(0, view.minutes + 1, every):
        x = LEFT + inner_w * minute / max(view.minutes, 1)
        when = timezone.localtime(view.since + dt.timedelta(minutes=minute)).strftime("%H:%M")
        parts.append(
            f'<text class="k2b-axis" x="{x:.1f}" y="{HEIGHT - 8}" '
            f'text-anchor="{"end" if minute == view.minutes else "middle"}">'
            f"{when}</text>"
        )
    for values, css, _ in series:
        parts.append(f'<polyline class="{css}" points="{_points(values, top)}"/>')
    totals = ", ".join(f"{sum(values)} {label}" for values, _, label in series)
    label = f"Runs per minute, {overview.WINDOWS[view.window][1]}: {totals}"
    # Only numbers and the fixed labels above go into this markup.
    return format_html(
        '<svg class="k2b-chart" role="img" viewBox="0 0 {} {}" width="100%" '
        'preserveAspectRatio="xMidYMid meet" aria-label="{}"><title>{}</title>{}</svg>',
        WIDTH,
        HEIGHT,
        label,
        label,
        mark_safe("".join(parts)),  # numbers and the constants above only
    )


def legend() -> SafeString:
    return format_html_join(
        "",
        '<span class="k2b-legend"><span class="k2b-swatch {}"></span>{}</span>',
        ((css, label) for _, css, label in SERIES),
    )


def age_text(seconds: float | None) -> str:
    """How long something has waited, at a glance: "45 s", "12 min", "3.5 h"."""
    if seconds is None:
        return "—"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _count(n: int) -> str:
    return f"{n:,}+" if n >= overview.COUNT_CAP else f"{n:,}"


def overview_view(model_admin: ModelAdmin, request: HttpRequest) -> HttpResponse:
    """Runs by status, throughput, the queue's age, incidents, workers, failing codes."""
    if not can_view_runs(request):
        raise PermissionDenied
    window = request.GET.get("window", "hour")
    if window not in overview.WINDOWS:
        window = "hour"
    view = overview.read(window)
    context: dict[str, Any] = {
        **model_admin.admin_site.each_context(request),
        "opts": model_admin.opts,
        "app_label": model_admin.opts.app_label,
        "media": model_admin.media,
        "title": "Workflow overview",
        "view": view,
        "window_label": overview.WINDOWS[window][1],
        "windows": [(name, label) for name, (_, label) in overview.WINDOWS.items()],
        "active": [(status, _count(n)) for status, n in view.active.items()],
        "finished": list(view.finished.items()),
        "queued_due": _count(view.queued_due),
        "oldest_due": age_text(view.oldest_due_s),
        "chart": chart_svg(view),
        "legend": legend(),
    }
    return TemplateResponse(request, "admin/k2b_workflows/overview.html", context)


def failures_view(model_admin: ModelAdmin, request: HttpRequest) -> HttpResponse:
    """The Failures page: failed runs grouped by exception class or code and hour (#49)."""
    if not can_view_runs(request):
        raise PermissionDenied
    try:
        hours = int(request.GET.get("hours", failures.DEFAULT_HOURS))
    except ValueError:
        hours = failures.DEFAULT_HOURS
    hours = max(1, min(hours, failures.MAX_HOURS))
    read = failures.read(hours)
    changelist = reverse("admin:k2b_workflows_workflowrun_changelist")
    rows = []
    for group in read.groups:
        query = {
            "status__exact": "failed",
            "workflow_name": group.workflow_name,
            "finished_at__gte": group.hour.isoformat(),
            "finished_at__lt": (group.hour + dt.timedelta(hours=1)).isoformat(),
        }
        if group.task_path:
            query["task_path"] = group.task_path
        if group.is_exception:
            query["task_attempts__exception_class_path"] = group.kind
        else:
            query["error_code"] = group.kind
        rows.append({"group": group, "url": f"{changelist}?{urlencode(query)}"})
    context: dict[str, Any] = {
        **model_admin.admin_site.each_context(request),
        "opts": model_admin.opts,
        "app_label": model_admin.opts.app_label,
        "media": model_admin.media,
        "title": "Failures",
        "rows": rows,
        "hours": hours,
        "choices": [1, 6, 24, 72, failures.MAX_HOURS],
        "read": read,
        "scan_cap": f"{failures.SCAN_CAP:,}",
    }
    return TemplateResponse(request, "admin/k2b_workflows/failures.html", context)
