"""The Schedules page: add, edit, pause, resume and "run now", each with its permission.

The failure this page guards against: an operator's change to a schedule
that nobody can account for afterwards, or that fires something else than
the operator saw. So every change is a ``LogEntry`` naming the operator;
pause, resume and "run now" need their own permissions
(``pause_workflowschedule``, ``run_workflowschedule``) beyond "change"; the
form shows the next five fire times of the spec as it is typed (a small
JSON endpoint, the same arithmetic the passes use) and refuses a bad spec
naming the field. A decorator's schedule is read-only here but for pausing:
its spec belongs to the code, and ``migrate`` would write it back.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import get_object_or_404
from django.urls import path, reverse
from django.utils import timezone
from django.utils.dateparse import parse_duration
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.views.decorators.http import require_POST

from ..exceptions import InvalidInput, InvalidSchedule, UnknownWorkflow
from ..kernel import clock, schedule_passes
from ..lazy import LazyModule
from ..models import WorkflowRun, WorkflowSchedule, WorkflowScheduleSkip
from ..schedules import Schedule, zone
from ..workflows import get_workflow
from .filters import WorkflowFilter

if TYPE_CHECKING:
    from .. import scheduling
    from . import views as admin_views
else:
    # Only requests use these (see lazy.py).
    admin_views = LazyModule("k2b_workflows.admin.views")
    scheduling = LazyModule("k2b_workflows.scheduling")

PAUSE_PERMISSION = "k2b_workflows.pause_workflowschedule"
RUN_PERMISSION = "k2b_workflows.run_workflowschedule"
PREVIEW_TICKS = 5
SPEC_FORM_FIELDS = ("cron", "every", "timezone", "input", "catch_up", "overlap", "jitter")


def _when(value: dt.datetime | None) -> str:
    return "—" if value is None else timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S %Z")


def _fires(value: dt.datetime, tz: str) -> str:
    """A fire time as the site shows times, and in the schedule's own zone beside it."""
    shown = _when(value)
    if tz and tz != "UTC":
        try:
            local = value.astimezone(zone(tz))
        except InvalidSchedule:
            return shown
        shown += f" ({local.strftime('%a %H:%M:%S %Z')} {tz})"
    return shown


def preview(
    cron: str | None, every: dt.timedelta | None, tz: str, *, after: dt.datetime | None = None
) -> list[dt.datetime]:
    """The next five fire times of a spec typed now (raises ``InvalidSchedule``)."""
    spec = Schedule(cron or None, every=every, timezone=tz or "UTC")
    return schedule_passes.preview(spec, after or clock.now(), PREVIEW_TICKS)


class ScheduleForm(forms.ModelForm):
    """The spec, checked by ``Schedule`` itself: an error lands on the field it names."""

    input = forms.JSONField(
        required=False,
        initial=dict,
        help_text='Each run\'s input, a JSON object; the run gets "scheduled_for" besides.',
    )

    class Meta:
        model = WorkflowSchedule
        fields = ("schedule_id", "workflow_name", "workflow_version", *SPEC_FORM_FIELDS)
        help_texts = {
            "cron": "5 fields (minute hour day month weekday) or 6 with seconds first; "
            "read in the time zone. Leave empty for every.",
            "every": "A fixed interval of at least one second, e.g. 01:00:00 or 3600 "
            "(seconds). Leave empty for cron.",
            "timezone": "An IANA name (Europe/Berlin); cron only.",
            "jitter": "Each tick fires up to this much later (the same delay on every worker).",
        }

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        if self.errors or "cron" not in self.fields:
            return data  # a decorator's schedule: its spec is read-only here
        try:
            schedule = Schedule(
                data.get("cron") or None,
                every=data.get("every"),
                timezone=data.get("timezone") or "UTC",
                input=data.get("input") if data.get("input") is not None else {},
                # Choice fields' values, which Schedule checks again.
                catch_up=cast(str, data.get("catch_up")),
                overlap=cast(str, data.get("overlap")),
                jitter=data.get("jitter"),
            )
        except InvalidSchedule as exc:
            field = exc.field if exc.field in self.fields else None
            self.add_error(field, str(exc))
            return data
        data["cron"], data["input"] = schedule.cron or "", schedule.input
        try:
            get_workflow(data.get("workflow_name", ""), data.get("workflow_version"))
        except UnknownWorkflow as exc:
            field = "workflow_version" if data.get("workflow_version") else "workflow_name"
            self.add_error(field if field in self.fields else None, str(exc))
        return data


@admin.register(WorkflowSchedule)
class WorkflowScheduleAdmin(admin.ModelAdmin):
    form = ScheduleForm
    list_display = (
        "schedule_id",
        "name_column",
        "spec",
        "state_badge",
        "last_tick_shown",
        "next_fire",
    )
    list_filter = ("paused", "enabled", "source", ("workflow_name", WorkflowFilter))
    # A task's schedule names its task in its input: the call its ticks enqueue (#51).
    search_fields = ("schedule_id", "workflow_name", "input__task")
    search_help_text = "Schedule id, workflow or task path."
    actions = ["pause_schedules", "resume_schedules", "run_schedules_now"]
    readonly_fields = (
        "state_badge",
        "source",
        "next_five",
        "last_tick_shown",
        "last_runs",
        "skipped_ticks",
        "disabled_reason",
    )

    class Media:
        css = {"all": ["k2b_workflows/admin.css"]}
        js = ["k2b_workflows/schedule_preview.js"]

    # The list -------------------------------------------------------------------------------

    @admin.display(description="workflow or task", ordering="workflow_name")
    def name_column(self, row: WorkflowSchedule) -> str:
        return row.display_name

    @admin.display(description="spec")
    def spec(self, row: WorkflowSchedule) -> str:
        text = f"cron {row.cron} ({row.timezone})" if row.cron else f"every {row.every}"
        return format_html("<code>{}</code> {} / {}", text, row.catch_up, row.overlap)

    @admin.display(description="state", ordering="paused")
    def state_badge(self, row: WorkflowSchedule) -> str:
        tampered = row.seal_problem()
        if tampered is not None:
            # Written without the evidence key: no pass fires it, and the operator
            # must read every field before saving seals it again.
            return format_html(
                '<span class="k2b-badge k2b-status-failed" title="{}">tampered</span>', tampered
            )
        if not row.enabled:
            return format_html(
                '<span class="k2b-badge k2b-status-failed" title="{}">disabled</span>',
                row.disabled_reason,
            )
        if row.paused:
            return mark_safe('<span class="k2b-badge k2b-status-waiting">paused</span>')
        return mark_safe('<span class="k2b-badge k2b-status-succeeded">active</span>')

    @admin.display(description="last tick", ordering="last_tick")
    def last_tick_shown(self, row: WorkflowSchedule) -> str:
        return _when(row.last_tick)

    @admin.display(description="next fire", ordering="next_fire_at")
    def next_fire(self, row: WorkflowSchedule) -> str:
        if not row.enabled or row.paused:
            return "—"
        return _when(row.next_fire_at)

    # The page ----------------------------------------------------------------------------

    @admin.display(description="next five fire times")
    def next_five(self, row: WorkflowSchedule) -> str:
        ticks: list[dt.datetime] = []
        if row.pk and row.next_tick is not None:
            try:
                spec = row.spec()
            except InvalidInput as exc:
                return str(exc)
            ticks = [row.next_tick]
            while len(ticks) < PREVIEW_TICKS:
                ticks.append(spec.next_tick(ticks[-1], row.anchor))
            ticks = [row.fire_at(t) for t in ticks]
        items = format_html_join("", "<li>{}</li>", ((_fires(t, row.timezone),) for t in ticks))
        note = " (paused: none fires until resumed)" if row.paused else ""
        return format_html(
            '<ul id="k2b-schedule-preview" data-url="{}">{}</ul><span class="help">{}</span>',
            reverse("admin:k2b_workflows_workflowschedule_preview"),
            items,
            "As the spec is edited, from now; saved: from the next tick." + note,
        )

    @admin.display(description="last runs")
    def last_runs(self, row: WorkflowSchedule) -> str:
        if not row.pk:
            return "—"
        runs = WorkflowRun.objects.filter(schedule_id=row.schedule_id).order_by("-scheduled_for")[
            :10
        ]
        rows = format_html_join(
            "",
            '<tr><td>{}</td><td><a href="{}">{}</a></td><td>{}</td></tr>',
            (
                (_when(r.scheduled_for), admin_views.run_url(r.pk), r.pk, r.status)
                for r in runs.only("id", "scheduled_for", "status")
            ),
        )
        return (
            format_html("<table><tr><th>tick</th><th>run</th><th>status</th></tr>{}</table>", rows)
            if rows
            else "none yet"
        )

    @admin.display(description="skipped ticks")
    def skipped_ticks(self, row: WorkflowSchedule) -> str:
        if not row.pk:
            return "—"
        skips = WorkflowScheduleSkip.objects.filter(schedule=row)[:20]
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (_when(s.first_tick), _when(s.last_tick), s.count, s.get_reason_display())
                for s in skips
            ),
        )
        if not rows:
            return "none"
        return format_html(
            "<table><tr><th>from</th><th>to</th><th>ticks</th><th>why</th></tr>{}</table>", rows
        )

    def get_fields(self, request: HttpRequest, obj: WorkflowSchedule | None = None) -> Any:
        fields = ["schedule_id", "workflow_name", "workflow_version", *SPEC_FORM_FIELDS]
        if obj is None:
            return [*fields, "next_five"]
        return [
            *fields,
            "state_badge",
            "source",
            "disabled_reason",
            "next_five",
            "last_tick_shown",
            "last_runs",
            "skipped_ticks",
        ]

    def get_readonly_fields(self, request: HttpRequest, obj: WorkflowSchedule | None = None) -> Any:
        readonly = list(self.readonly_fields)
        if obj is not None:
            readonly.append("schedule_id")
            if obj.source == WorkflowSchedule.Source.DECORATOR:
                # Its spec is the code's: ``migrate`` would write it back.
                readonly += ["workflow_name", "workflow_version", *SPEC_FORM_FIELDS]
        return readonly

    def save_model(
        self, request: HttpRequest, obj: WorkflowSchedule, form: forms.ModelForm, change: bool
    ) -> None:
        if not change:
            obj.source = WorkflowSchedule.Source.ADMIN
        # The operator saved every field the form showed (a tampered row's badge
        # said so): their save seals the row again and starts its ticks afresh.
        obj.reviewed = True
        obj.save()

    # Permissions and actions ---------------------------------------------------------------

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PAUSE_PERMISSION)

    def has_run_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(RUN_PERMISSION)

    def _set_paused(
        self, request: HttpRequest, rows: Iterable[WorkflowSchedule], paused: bool
    ) -> int:
        changed = 0
        for row in rows:
            if row.paused == paused:
                continue
            row.paused = paused
            try:
                row.save()
            except InvalidSchedule as exc:
                self.message_user(request, f"{row.schedule_id}: {exc}", messages.ERROR)
                continue
            self.log_change(request, row, "Paused" if paused else "Resumed")
            changed += 1
        return changed

    @admin.action(description="Pause selected schedules", permissions=["pause"])
    def pause_schedules(self, request: HttpRequest, queryset: QuerySet) -> None:
        n = self._set_paused(request, queryset, True)
        self.message_user(request, f"Paused {n} schedule(s).", messages.SUCCESS)

    @admin.action(description="Resume selected schedules", permissions=["pause"])
    def resume_schedules(self, request: HttpRequest, queryset: QuerySet) -> None:
        n = self._set_paused(request, queryset, False)
        self.message_user(request, f"Resumed {n} schedule(s).", messages.SUCCESS)

    @admin.action(description="Run selected schedules now", permissions=["run"])
    def run_schedules_now(self, request: HttpRequest, queryset: QuerySet) -> None:
        for row in queryset:
            self._run_now(request, row)

    def _run_now(self, request: HttpRequest, row: WorkflowSchedule) -> None:
        try:
            run = scheduling.run_schedule_now(row)
        except (InvalidInput, UnknownWorkflow) as exc:
            self.message_user(request, f"{row.schedule_id}: {exc}", messages.ERROR)
            return
        self.log_change(request, row, f"Ran now: run {run.pk}")
        self.message_user(
            request,
            format_html(
                '{}: started run <a href="{}">{}</a>.',
                row.schedule_id,
                admin_views.run_url(run.pk),
                run.pk,
            ),
            messages.SUCCESS,
        )

    # Views ---------------------------------------------------------------------------------

    def get_urls(self) -> list:
        wrap = self.admin_site.admin_view
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"
        return [
            path("preview/", wrap(self.preview_view), name=f"{prefix}_preview"),
            path(
                "<path:object_id>/pause/",
                wrap(require_POST(self.pause_view)),
                name=f"{prefix}_pause",
            ),
            path(
                "<path:object_id>/resume/",
                wrap(require_POST(self.resume_view)),
                name=f"{prefix}_resume",
            ),
            path(
                "<path:object_id>/run-now/",
                wrap(require_POST(self.run_now_view)),
                name=f"{prefix}_run_now",
            ),
            *super().get_urls(),
        ]

    def preview_view(self, request: HttpRequest) -> JsonResponse:
        """``?cron=…&every=…&timezone=…`` → the next five fire times, or the error and its field."""
        if not (self.has_view_permission(request) or self.has_add_permission(request)):
            raise PermissionDenied
        every = None
        if text := request.GET.get("every"):
            every = parse_duration(text)
            if every is None:
                return JsonResponse(
                    {"error": "enter a duration such as 01:00:00 or 3600", "field": "every"},
                    status=400,
                )
        tz = request.GET.get("timezone") or "UTC"
        try:
            ticks = preview(request.GET.get("cron"), every, tz)
        except InvalidSchedule as exc:
            return JsonResponse({"error": str(exc), "field": exc.field}, status=400)
        return JsonResponse(
            {"ticks": [_fires(t, tz) for t in ticks], "utc": [t.isoformat() for t in ticks]}
        )

    def _object(self, request: HttpRequest, object_id: str, permission: str) -> WorkflowSchedule:
        if not request.user.has_perm(permission):
            raise PermissionDenied
        return get_object_or_404(WorkflowSchedule, pk=object_id)

    def _back(self, row: WorkflowSchedule) -> HttpResponseRedirect:
        return HttpResponseRedirect(
            reverse("admin:k2b_workflows_workflowschedule_change", args=[row.pk])
        )

    def pause_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        row = self._object(request, object_id, PAUSE_PERMISSION)
        self._set_paused(request, [row], True)
        return self._back(row)

    def resume_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        row = self._object(request, object_id, PAUSE_PERMISSION)
        self._set_paused(request, [row], False)
        return self._back(row)

    def run_now_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        row = self._object(request, object_id, RUN_PERMISSION)
        self._run_now(request, row)
        return self._back(row)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        extra = {
            **(extra_context or {}),
            "can_pause": self.has_pause_permission(request),
            "can_run": self.has_run_permission(request),
        }
        return super().change_view(request, object_id, form_url, extra)
