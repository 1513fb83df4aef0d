"""The operators' admin of runs and of the incident queue, read-only.

Nothing here writes to the kernel's tables directly: cancel, retry and the
resolution of an incident go through ``k2b_workflows.control``, which checks
the permission again, locks the run and appends the ledger entry naming the
operator. The views live in ``views``; what the run page draws is
computed in ``display``.
"""

from __future__ import annotations

import functools
import uuid
from typing import TYPE_CHECKING, Any, ClassVar

from django.contrib import admin
from django.db.models import F, Model, Prefetch, Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.utils.timesince import timesince

from .. import naming, settings
from ..kernel import clock, forks, seals
from ..kernel.evidence import hash_value
from ..lazy import LazyModule
from ..models import Incident, LedgerEntry, RunStatus, TaskAttempt, WorkerRecord, WorkflowRun
from ..progress import progress_of
from ..redaction import redact_text
from ..tasks import names as task_names
from ..unique import STATE_SETS, STATES
from .common import ReadOnlyMixin, field_names, pretty_json, short_hash, status_badge
from .filters import BatchFilter, QueueFilter, TaskFilter, WorkflowFilter
from .workers import worker_state_badge

if TYPE_CHECKING:
    from .. import incidents, versions
    from ..kernel import audit
    from ..tasks import runs as task_runs
    from . import display as admin_display
    from . import overview_views as admin_overview
    from . import settle as admin_settle
    from . import views as admin_views
else:
    # Only requests use these: a worker process imports this module and never them.
    admin_display = LazyModule("k2b_workflows.admin.display")
    admin_overview = LazyModule("k2b_workflows.admin.overview_views")
    admin_views = LazyModule("k2b_workflows.admin.views")
    admin_settle = LazyModule("k2b_workflows.admin.settle")
    versions = LazyModule("k2b_workflows.versions")
    incidents = LazyModule("k2b_workflows.incidents")
    audit = LazyModule("k2b_workflows.kernel.audit")
    # Only task runs' pages: it imports django.tasks, which a project may not have (#37).
    task_runs = LazyModule("k2b_workflows.tasks.runs")


def is_task_run(run: WorkflowRun) -> bool:
    """Whether ``run`` is a django.tasks task call (``k2b_workflows.tasks``)."""
    return task_names.is_task_workflow(run.workflow_name)


def _attempts(run: WorkflowRun) -> list[TaskAttempt]:
    """A task run's failed attempts as its ``TaskResult`` has them: each once, none the
    worker did not write (``tasks.runs.sealed_attempts``, which logs each refused row)."""
    rows = list(TaskAttempt.objects.filter(run_id=run.pk).order_by("id"))
    return task_runs.sealed_attempts(run.pk, rows) if rows else []


@admin.register(WorkflowRun)
class WorkflowRunAdmin(ReadOnlyMixin, admin.ModelAdmin):
    list_display: tuple[str, ...] = (
        "short_id",
        "status_badge",
        "name_column",
        "app_id",
        "step_column",
        "generation_column",
        "failures_column",
        "age",
    )
    list_display_links: tuple[str, ...] | None = ("short_id",)
    list_filter: ClassVar[tuple[Any, ...]] = (
        "status",
        "app_id",
        ("workflow_name", WorkflowFilter),
        TaskFilter,
        QueueFilter,
        BatchFilter,
        "error_code",
        "created_at",
    )
    # A substring of a task's path finds its calls (#51). Not through an index: the
    # list's order (newest first) reads the table whatever is searched, as the
    # workflow name's search did; the filter by task is the indexed way to one task.
    search_fields = ("=idempotency_key", "workflow_name", "task_path")
    search_help_text = "Run id (full), idempotency key (exact), workflow name or task path."
    date_hierarchy = None
    list_per_page = 50
    show_full_result_count = False
    actions = [
        "cancel_runs",
        "cancel_calls",
        "retry_runs",
        "reenqueue_runs",
        "fork_runs",
        "settle_incidents",
    ]
    change_form_template = "admin/k2b_workflows/workflowrun/change_form.html"
    change_list_template = "admin/k2b_workflows/workflowrun/change_list.html"
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "id",
                    "status_badge",
                    "progress_bar",
                    "integrity",
                    "held_by",
                    "workflow_name",
                    "workflow_version",
                    "code_column",
                    "app_id",
                    "idempotency_key_shown",
                    "principal_hash",
                    "parent_link",
                    "root_link",
                    "forked_from_link",
                    "forks_links",
                )
            },
        ),
        (
            "Input and result",
            {"fields": ("input_json", "output_json", "error_code", "error_message_shown")},
        ),
        (
            "Execution",
            {
                "classes": ["collapse"],
                "fields": (
                    "current_step",
                    "attention_step",
                    "generation",
                    "consecutive_failures",
                    "claimed_by",
                    "lease_expires_at",
                    "run_after",
                    "created_at",
                    "updated_at",
                    "finished_at",
                ),
            },
        ),
        (
            "Flow control",
            {
                "classes": ["collapse"],
                "fields": (
                    "concurrency_key",
                    "holds_slot",
                    "priority",
                    "deferred_by",
                    "unique_shown",
                    "fairness_key",
                    "fairness_weight",
                    "fair_line",
                ),
            },
        ),
        (
            "Waiting for",
            {"fields": ("wait_kind", "wait_key", "wait_deadline", "waiting_since", "wait_step")},
        ),
    )
    #: Shown first on the page of a django.tasks task's run (#37).
    task_fieldset = (
        "Task",
        {
            "fields": (
                "task_path",
                "task_arguments",
                "task_attempts",
                "task_errors",
                "task_return_value",
            )
        },
    )
    readonly_fields = (*field_names(fieldsets), *field_names((task_fieldset,)))

    class Media:
        css = {"all": ["k2b_workflows/admin.css"]}

    # Columns and fields --------------------------------------------------------------------

    @admin.display(description="run", ordering="id")
    def short_id(self, run: WorkflowRun) -> str:
        return str(run.pk)[:8]

    @admin.display(description="unique key")
    def unique_shown(self, run: WorkflowRun) -> str:
        """The call's ``Unique`` key and the states it holds it in; "-": none, or let go
        (its period passed, or an operator's retry after it no longer held it)."""
        if not run.unique_key:
            return "-"
        held: frozenset[str] = next(
            (s for s, code in STATE_SETS.items() if code == run.unique_states), frozenset()
        )
        states = ", ".join(state for state in STATES if state in held)
        return f"{run.unique_key[:16]}… (held while {states})"

    @admin.display(description="status", ordering="status")
    def status_badge(self, run: WorkflowRun) -> str:
        return status_badge(run.status)

    @admin.display(description="progress")
    def progress_bar(self, run: WorkflowRun) -> str:
        """What its step last reported (``set_progress``): a bar, done/total, the note and
        when; kept after the run ended. Display only."""
        progress = progress_of(run)
        if progress is None:
            return "-"
        total = progress.total
        shown = str(progress.done) if total is None else f"{progress.done} / {total}"
        fraction = progress.fraction
        if fraction is not None:
            bar = format_html(
                '<progress class="k2b-progress" value="{}" max="{}"></progress> ',
                progress.done if total else 1,  # 0 of 0 is done
                total or 1,
            )
            shown = f"{shown} ({fraction:.0%})"
        else:  # no total: an indeterminate bar
            bar = format_html('<progress class="k2b-progress"></progress> ')
        return format_html(
            '{}<span class="k2b-progress-text">{}</span>{} <span class="k2b-progress-at">'
            "updated {} ago ({})</span>",
            bar,
            shown,
            format_html(" &middot; {}", redact_text(progress.note)) if progress.note else "",
            timesince(progress.updated_at, clock.now()),
            progress.updated_at.isoformat(timespec="seconds"),
        )

    @admin.display(description="step", ordering="current_step")
    def step_column(self, run: WorkflowRun) -> Any:
        return run.current_step

    @admin.display(description="gen.", ordering="generation")
    def generation_column(self, run: WorkflowRun) -> int:
        return run.generation

    @admin.display(description="failures", ordering="consecutive_failures")
    def failures_column(self, run: WorkflowRun) -> int:
        return run.consecutive_failures

    @admin.display(description="age", ordering="-created_at")
    def age(self, run: WorkflowRun) -> str:
        return timesince(run.created_at, clock.now())

    @admin.display(description="code")
    def code_column(self, run: WorkflowRun) -> str:
        note = versions.run_code_note(run, live=versions.live_pairs())
        if note:
            return format_html('<strong class="k2b-no-code">{}</strong>', note)
        return "registered" if run.status not in ("succeeded", "failed", "canceled") else "—"

    @admin.display(description="input")
    def input_json(self, run: WorkflowRun) -> str:
        return pretty_json(run.input)

    @admin.display(description="output")
    def output_json(self, run: WorkflowRun) -> str:
        return pretty_json(run.output) if run.output is not None else "—"

    @admin.display(description="integrity")
    def integrity(self, run: WorkflowRun) -> str:
        """Verified now, from the database, with the evidence keys: a finished run
        whose resolution was edited shows it here, not only at its next claim."""
        problem = audit.stored_problem(run.pk, run._state.db or settings.database())
        if problem is None:
            return mark_safe(
                '<span class="k2b-badge k2b-integrity-verified">verified</span>'
                " journal and ledger chains, anchors and run seals intact"
            )
        label = "tampered" if problem.kind == "seal" else "broken"
        return format_html(
            '<span class="k2b-badge k2b-integrity-broken">{}</span> <strong>{}</strong>',
            label,
            str(problem),
        )

    @admin.display(description="idempotency key")
    def idempotency_key_shown(self, run: WorkflowRun) -> str:
        return redact_text(run.idempotency_key) or "—"

    @admin.display(description="error message")
    def error_message_shown(self, run: WorkflowRun) -> str:
        return redact_text(run.error_message) or "—"

    @admin.display(description="principal (hash)")
    def principal_hash(self, run: WorkflowRun) -> str:
        return short_hash(hash_value(run.principal)) if run.principal is not None else "—"

    @admin.display(description="parent")
    def parent_link(self, run: WorkflowRun) -> str:
        if run.parent_id is None:
            return "—"
        return format_html(
            '<a href="{}">{}</a> (step {}, child {})',
            admin_views.run_url(run.parent_id),
            run.parent_id,
            run.parent_step,
            run.child_index,
        )

    @admin.display(description="held by")
    def held_by(self, run: WorkflowRun) -> str:
        """Which worker process executes the run now: where to look when it seems stuck."""
        if run.status != RunStatus.RUNNING or not run.claimed_by:
            return "—"
        worker = WorkerRecord.objects.filter(pk=run.claimed_by).first()
        if worker is None:
            return format_html("<code>{}</code> (no longer registered)", run.claimed_by)
        return format_html(
            '<a href="{}">{}</a> {} · heartbeat {} ago',
            reverse("admin:k2b_workflows_workerrecord_change", args=[worker.pk]),
            worker.worker_id,
            worker_state_badge(worker),
            admin_display.format_duration(clock.now() - worker.heartbeat_at),
        )

    @admin.display(description="root")
    def root_link(self, run: WorkflowRun) -> str:
        if run.root_id is None or run.root_id == run.pk:
            return "this run"
        return format_html('<a href="{}">{}</a>', admin_views.run_url(run.root_id), run.root_id)

    @admin.display(description="forked from")
    def forked_from_link(self, run: WorkflowRun) -> str:
        if run.forked_from_id is None:
            return "—"
        return format_html(
            '<a href="{}">{}</a>', admin_views.run_url(run.forked_from_id), run.forked_from_id
        )

    @admin.display(description="forks")
    def forks_links(self, run: WorkflowRun) -> str:
        """The runs forked from this one, newest first (a few: the ledger names them all)."""
        forks = list(
            WorkflowRun.objects.filter(forked_from=run).order_by("-created_at").only("id")[:10]
        )
        if not forks:
            return "—"
        return format_html_join(
            ", ", '<a href="{}">{}</a>', ((admin_views.run_url(f.pk), f.pk) for f in forks)
        )

    def get_fieldsets(self, request: HttpRequest, obj: WorkflowRun | None = None) -> Any:
        # The wait fields keep a run's last wait after it moved on: "Waiting for"
        # while it waits, "Last waited for" after (a succeeded run said it was
        # still waiting for its AI task, #38), nothing for a run that never waited.
        fieldsets: tuple[Any, ...] = self.fieldsets
        if obj is not None and obj.status != RunStatus.WAITING:
            if not obj.wait_kind:
                fieldsets = self.fieldsets[:-1]
            else:
                (_, wait_fields) = self.fieldsets[-1]
                fieldsets = (*self.fieldsets[:-1], ("Last waited for", wait_fields))
        if obj is not None and is_task_run(obj):
            fieldsets = (self.task_fieldset, *fieldsets)
        return fieldsets

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        # Lists never need the JSON bodies: ten runs with 10 MB inputs would
        # otherwise be read whole for a table that shows none of it. The run
        # page reads them when it draws them. A task's path has a column of its own.
        return super().get_queryset(request).defer("input", "output", "principal")

    # django.tasks task runs (#37) -----------------------------------------------------------

    @admin.display(description="workflow or task", ordering="workflow_name")
    def name_column(self, run: WorkflowRun) -> str:
        """A task call by its task's path, with its effect and queue under it (#51)."""
        effect = naming.EFFECT_OF_WORKFLOW.get(run.workflow_name)
        if effect is None:
            return run.display_name
        return format_html(
            '{}<div class="k2b-sub">task, {} · queue {}</div>', run.display_name, effect, run.queue
        )

    @admin.display(description="task")
    def task_path(self, run: WorkflowRun) -> str:
        """The path in the run's input, said not to be the one enqueued when the run's
        start seal does not verify: the runtime role can write the input (#47)."""
        shown = format_html("<code>{}</code>", run.input.get("task", ""))
        problem = seals.start_problem(run)
        if problem is None:
            return shown
        return format_html(
            '{} <span class="k2b-badge k2b-integrity-broken">tampered</span> not the task'
            " enqueued: the run's start seal does not verify ({})",
            shown,
            problem,
        )

    @admin.display(description="arguments")
    def task_arguments(self, run: WorkflowRun) -> str:
        """Redacted as every run's input is (``pretty_json``)."""
        return pretty_json({"args": run.input.get("args"), "kwargs": run.input.get("kwargs")})

    @admin.display(description="failed attempts")
    def task_attempts(self, run: WorkflowRun) -> str:
        """The attempts a caller's ``TaskResult`` shows: a forged or copied row is not one."""
        rows = _attempts(run)
        if not rows:
            return "none"
        return format_html_join(
            mark_safe("<br>"),
            "#{} on <code>{}</code> at {}: <code>{}</code>",
            ((r.attempt, r.worker_id or "?", r.started_at, r.exception_class_path) for r in rows),
        )

    @admin.display(description="errors")
    def task_errors(self, run: WorkflowRun) -> str:
        """The failed attempts' tracebacks, scrubbed when they were stored."""
        texts = [redact_text(r.traceback) for r in _attempts(run)]
        if not texts:
            return "—"
        return format_html_join("", '<pre class="k2b-json">{}</pre>', ((t,) for t in texts))

    @admin.display(description="return value")
    def task_return_value(self, run: WorkflowRun) -> str:
        if run.status != RunStatus.SUCCEEDED:
            return "—"
        return pretty_json(run.output)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        """A full run id matches that run; anything else searches keys and workflow names."""
        term = search_term.strip()
        try:
            run_id = uuid.UUID(term)
        except ValueError:
            return super().get_search_results(request, queryset, search_term)
        return queryset.filter(Q(pk=run_id) | Q(idempotency_key=term)), False

    #: The lookups the Failures page's links filter by, beyond the list's own filters.
    FAILURE_LOOKUPS = frozenset(
        {
            "finished_at__gte",
            "finished_at__lt",
            "task_path",
            "task_attempts__exception_class_path",
        }
    )

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        return lookup in self.FAILURE_LOOKUPS or super().lookup_allowed(lookup, value, request)

    # Permissions and actions ---------------------------------------------------------------

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("k2b_workflows.cancel_workflowrun")

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("k2b_workflows.retry_workflowrun")

    def has_fork_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(admin_views.FORK_PERMISSION)

    def has_resolve_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(admin_views.RESOLVE_PERMISSION)

    @admin.action(description="Cancel selected runs…", permissions=["cancel"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        return admin_views.confirm_operation(
            self, request, queryset, "cancel", action_name="cancel_runs"
        )

    @admin.action(description="Settle selected incidents (one decision)…", permissions=["resolve"])
    def settle_incidents(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        return admin_settle.settle_incidents(
            self, request, queryset, action_name="settle_incidents"
        )

    @admin.action(description="Cancel selected task calls…", permissions=["cancel"])
    def cancel_calls(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        return admin_views.confirm_operation(
            self, request, queryset, "cancel_call", action_name="cancel_calls"
        )

    @admin.action(description="Retry selected failed runs now…", permissions=["retry"])
    def retry_runs(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        return admin_views.confirm_operation(
            self, request, queryset, "retry", action_name="retry_runs"
        )

    @admin.action(description="Re-enqueue selected runs as new runs…", permissions=["retry"])
    def reenqueue_runs(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        return admin_views.confirm_operation(
            self, request, queryset, "reenqueue", action_name="reenqueue_runs"
        )

    @admin.action(description="Fork selected failed runs from their failure…", permissions=["fork"])
    def fork_runs(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        return admin_views.confirm_operation(
            self, request, queryset, "fork", action_name="fork_runs"
        )

    # Views ---------------------------------------------------------------------------------

    def _operation_view(
        self, request: HttpRequest, object_id: str, *, operation: str
    ) -> HttpResponse:
        return admin_views.run_operation_view(self, request, object_id, operation)

    def get_urls(self) -> list:
        wrap = self.admin_site.admin_view
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"
        return [
            path(
                "dry-run/",
                wrap(lambda request: admin_views.dry_run_view(self, request)),
                name=f"{prefix}_dry_run",
            ),
            path(
                "concurrency-key/",
                wrap(lambda request: admin_views.concurrency_key_view(self, request)),
                name=f"{prefix}_concurrency_key",
            ),
            path(
                "<path:object_id>/fork/",
                wrap(lambda request, object_id: admin_views.fork_view(self, request, object_id)),
                name=f"{prefix}_fork",
            ),
            path(
                "overview/",
                wrap(lambda request: admin_overview.overview_view(self, request)),
                name=f"{self.opts.app_label}_overview",
            ),
            path(
                "failures/",
                wrap(lambda request: admin_overview.failures_view(self, request)),
                name=f"{self.opts.app_label}_failures",
            ),
            *(
                path(
                    f"<path:object_id>/{operation}/",
                    wrap(functools.partial(self._operation_view, operation=operation)),
                    name=f"{prefix}_{operation}",
                )
                for operation in ("cancel", "retry")
            ),
            *super().get_urls(),
        ]

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        admin_views.run_id_or_404(object_id)
        run = self.get_object(request, object_id)
        if run is None:
            raise Http404(f"no run {object_id}")
        extra = dict(extra_context or {})
        if run is not None:
            extra.update(admin_display.run_page_context(run))
            guide = admin_display.incident_guide(run)
            extra.update(
                status_badge=status_badge(run.status),
                incident=guide,
                divergence=admin_display.incident_divergence(run),
                code_traceback=admin_display.incident_traceback(run),
                incident_story=incidents.story_of(run) if guide is not None else [],
                call_arguments=pretty_json(admin_display.call_arguments(run))
                if guide is not None
                else "",
                can_resolve=guide is not None
                and "resolve" in guide.actions
                and self.has_resolve_permission(request),
                can_cancel=run.status not in ("succeeded", "failed", "canceled")
                and self.has_cancel_permission(request),
                can_retry=not admin_views._can_retry(run) and self.has_retry_permission(request),
                can_fork=run.status in forks.FORKABLE_STATUSES
                and self.has_fork_permission(request),
            )
        return super().change_view(request, object_id, form_url, extra)


@admin.register(Incident)
class IncidentAdmin(WorkflowRunAdmin):
    """The queue of runs that need an operator's decision, oldest first."""

    # Few, dense columns: the queue must fit next to the filters on a laptop.
    list_display = ("incident", "step", "arguments", "answers", "evidence_hashes", "resolve_link")
    list_display_links = None
    list_filter = ("app_id", ("workflow_name", WorkflowFilter), TaskFilter)
    actions = ["settle_incidents", "cancel_runs"]
    change_list_template = "admin/k2b_workflows/incident/change_list.html"
    ordering = ("updated_at", "created_at")

    def has_view_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        # An operator who may resolve, or see runs, may see the queue.
        return (
            super().has_view_permission(request, obj)
            or request.user.has_perm("k2b_workflows.view_workflowrun")
            or self.has_resolve_permission(request)
        )

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return (
            super()
            .get_queryset(request)
            .filter(status=RunStatus.NEEDS_ATTENTION)
            # The arguments column: the input only where it is small, its size read
            # from the stored value's header; a large one is never fetched for a list.
            .annotate(call_input=admin_display.bounded_input())
            .prefetch_related(
                # Only the entries of the step in doubt: a run that polled for a week
                # has thousands on other steps.
                Prefetch(
                    "ledger",
                    queryset=LedgerEntry.objects.filter(seq=F("run__attention_step")).order_by(
                        "id"
                    ),
                    to_attr="entries",
                )
            )
        )

    @admin.display(description="step", ordering="attention_step")
    def step(self, run: Incident) -> str:
        dispatch = admin_display.incident_dispatch(run, run.entries)
        if dispatch is None:
            return str(run.attention_step)
        return format_html(
            '{}: {}<div class="k2b-effect">{}</div>',
            run.attention_step,
            dispatch.action_name,
            dispatch.get_effect_display(),
        )

    @admin.display(description="called with")
    def arguments(self, run: Incident) -> str:
        """The call's arguments (a workflow run's input), redacted as every input is."""
        if run.call_input is None:
            return format_html(
                '<span class="k2b-sub">{}</span>', "too large for a list: see the run"
            )
        return pretty_json(admin_display.call_arguments(run, run.call_input))

    @admin.display(description="answers so far")
    def answers(self, run: Incident) -> str:
        answers = admin_display.incident_answers(run, run.entries)
        if not answers:
            return format_html("<span>{}</span>", run.error_code or "—")
        return format_html(
            '<ul class="k2b-answers">{}</ul>',
            format_html_join(
                "",
                '<li><span class="k2b-kind k2b-kind-{}">{}</span> {}</li>',
                ((a.kind, a.kind, redact_text(a.message)) for a in answers),
            ),
        )

    @admin.display(description="evidence")
    def evidence_hashes(self, run: Incident) -> str:
        dispatch = admin_display.incident_dispatch(run, run.entries)
        if dispatch is None:
            return "—"
        rows = (
            ("def.", short_hash(dispatch.definition_hash)),
            ("input", short_hash(dispatch.input_hash)),
            ("preview", short_hash(dispatch.preview_hash)),
        )
        return format_html(
            '<dl class="k2b-hashes">{}</dl>',
            format_html_join("", "<dt>{}</dt><dd>{}</dd>", rows),
        )

    @admin.display(description="run", ordering="updated_at")
    def incident(self, run: Incident) -> str:
        return format_html(
            '<a href="{}">{}</a><div class="k2b-sub">{}</div>'
            '<div class="k2b-sub" title="{}">{} ago</div>',
            admin_views.run_url(run),
            str(run.pk)[:8],
            naming.described_name(run.workflow_name, run.task_path),
            run.updated_at.isoformat(),
            timesince(run.updated_at),
        )

    @admin.display(description="")
    def resolve_link(self, run: Incident) -> str:
        """Placeholder for the actions column; ``get_list_display`` binds it to the request."""
        return ""

    def incident_links(self, request: HttpRequest, run: WorkflowRun) -> str:
        """The actions that apply to this incident's code, and only those (see IncidentGuide)."""
        guide = admin_display.incident_guide(run)
        links = []
        for action in guide.actions if guide else ():
            if action == "resolve" and self.has_resolve_permission(request):
                url = reverse("admin:k2b_workflows_incident_resolve", args=[run.pk])
                links.append(("k2b-resolve", url, "Resolve…"))
            elif action == "retry" and self.has_retry_permission(request):
                url = reverse("admin:k2b_workflows_workflowrun_retry", args=[run.pk])
                links.append(("k2b-retry", url, "Retry…"))
            elif action == "cancel" and self.has_cancel_permission(request):
                url = reverse("admin:k2b_workflows_workflowrun_cancel", args=[run.pk])
                links.append(("k2b-cancel", url, "Cancel…"))
        return format_html_join(" ", '<a class="button {}" href="{}">{}</a>', links)

    def get_list_display(self, request: HttpRequest) -> Any:
        columns = tuple(c for c in self.list_display if c != "resolve_link")
        if not (
            self.has_resolve_permission(request)
            or self.has_retry_permission(request)
            or self.has_cancel_permission(request)
        ):
            return columns

        # A ModelAdmin serves every request: the operator's permissions are bound
        # into this request's column, never stored on the instance.
        @admin.display(description="")
        def actions(run: WorkflowRun) -> str:
            return self.incident_links(request, run)

        return (*columns, actions)

    def get_urls(self) -> list:
        wrap = self.admin_site.admin_view
        return [
            path(
                "<path:object_id>/resolve/",
                wrap(
                    lambda request, object_id: admin_views.resolve_incident_view(
                        self, request, object_id
                    )
                ),
                name="k2b_workflows_incident_resolve",
            ),
            *admin.ModelAdmin.get_urls(self),
        ]

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        # A resolved incident leaves the queue; its page is the run's page.
        return HttpResponseRedirect(admin_views.run_url(admin_views.run_id_or_404(object_id)))
