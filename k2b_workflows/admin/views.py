"""The operators' admin views: resolving an incident, cancel, retry and fork, dry runs.

Each view changes nothing until a confirmation page has been submitted, calls
only the public control functions (which check permissions again and append
the ledger entries), and writes what it did to Django's admin log.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.contrib import messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponseRedirect,
)
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import reverse

from .. import naming, settings
from ..control import (
    EFFECT_CONFIRMED,
    RESOLVABLE_CODES,
    cancel_workflow_run,
    fork_plan,
    fork_workflow_run,
    reenqueue_refusal,
    reenqueue_workflow_run,
    resolve_effect,
    retry_refusal,
    retry_words,
    retry_workflow_run,
)
from ..dryrun import dry_run
from ..exceptions import (
    EvidenceChanged,
    ForkRefused,
    InvalidInput,
    NotRetryable,
    ResolutionRefused,
    UnknownWorkflow,
)
from ..incidents import story_of
from ..kernel import flow
from ..models import TERMINAL_STATUSES, LedgerEntry, RunStatus, WorkflowRun
from ..redaction import redact
from ..tasks.names import EFFECT_OF_WORKFLOW
from .common import pretty_json
from .display import (
    call_arguments,
    concurrency_key_url,
    effect_key_shown,
    incident_answers,
    incident_dispatch,
)
from .forms import DECISION_CHOICES, DryRunForm, ForkForm, ReasonForm, ResolutionForm

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin
    from django.db.backends.base.base import BaseDatabaseWrapper

RESOLVE_PERMISSION = "k2b_workflows.resolve_effect"
FORK_PERMISSION = "k2b_workflows.fork_workflowrun"
DECISION_LABELS: dict[str, str] = {
    LedgerEntry.Kind.RESOLVED_CONFIRMED: "effect confirmed",
    LedgerEntry.Kind.RESOLVED_ABSENT: "effect absent",
}


def run_id_or_404(object_id: str) -> uuid.UUID:
    """The run id in an admin URL, or 404: a malformed id never reaches the database."""
    try:
        return uuid.UUID(str(object_id))
    except ValueError:
        raise Http404(f"no run {str(object_id)[:60]!r}") from None


def can_view_runs(request: HttpRequest) -> bool:
    return request.user.has_perm("k2b_workflows.view_workflowrun") or request.user.has_perm(
        "k2b_workflows.change_workflowrun"
    )


def run_url(run: WorkflowRun | uuid.UUID | str) -> str:
    run_id = run.pk if isinstance(run, WorkflowRun) else run
    return reverse("admin:k2b_workflows_workflowrun_change", args=[run_id])


def _admin_context(model_admin: ModelAdmin, request: HttpRequest, **extra: Any) -> dict[str, Any]:
    return {
        **model_admin.admin_site.each_context(request),
        "opts": model_admin.opts,
        "app_label": model_admin.opts.app_label,
        "media": model_admin.media,
        **extra,
    }


# Resolution -------------------------------------------------------------------------------


def _last_resolution(run_id: uuid.UUID) -> LedgerEntry | None:
    return (
        LedgerEntry.objects.filter(
            run_id=run_id,
            kind__in=[LedgerEntry.Kind.RESOLVED_CONFIRMED, LedgerEntry.Kind.RESOLVED_ABSENT],
        )
        .order_by("-id")
        .first()
    )


def _refusal_message(run_id: uuid.UUID) -> str:
    """Why a decision was not applied, naming the operator who decided first, if one did."""
    run = WorkflowRun.objects.get(pk=run_id)
    last = _last_resolution(run_id)
    if last is not None:
        when = last.created_at.strftime("%Y-%m-%d %H:%M:%S UTC")
        return (
            f"Nothing changed: {last.actor} already resolved step {last.seq} as "
            f'"{DECISION_LABELS[last.kind]}" at {when}. The run is now {run.status}.'
        )
    if run.status == RunStatus.NEEDS_ATTENTION and run.error_code not in RESOLVABLE_CODES:
        # Not a refusal of a decision: this incident is not about an effect at all.
        return (
            f"Run {run.pk} needs attention with {run.error_code}, which is not a decision on an"
            " effect: its actions are on the run's page."
        )
    return (
        f"Nothing changed: run {run.pk} is {run.status}; it is not waiting for a decision"
        " on an effect."
    )


def resolve_incident_view(
    model_admin: ModelAdmin, request: HttpRequest, object_id: str
) -> HttpResponse:
    """The per-incident resolution form: fill in, confirm, then ``resolve_effect``.

    Two operators may confirm at once; the run row lock inside ``resolve_effect``
    lets one win, and the other is told who decided first. A decision taken on
    evidence that changed since the form was shown is refused too.
    """
    if not request.user.has_perm(RESOLVE_PERMISSION):
        raise PermissionDenied
    run = get_object_or_404(WorkflowRun, pk=run_id_or_404(object_id))
    confirming = False
    if request.method == "POST" and "_confirm" in request.POST and "_edit" not in request.POST:
        # No status check here: resolve_effect decides under the run's row lock,
        # so of two operators confirming at once exactly one wins.
        form = ResolutionForm(request.POST)
        if form.is_valid():
            response = _apply_resolution(model_admin, request, run, form)
            if response is not None:
                return response
        elif run.status != RunStatus.NEEDS_ATTENTION:
            messages.error(request, _refusal_message(run.pk))
            return HttpResponseRedirect(run_url(run))
    elif (
        run.status != RunStatus.NEEDS_ATTENTION
        or run.attention_step is None
        or run.error_code not in RESOLVABLE_CODES
    ):
        messages.error(request, _refusal_message(run.pk))
        return HttpResponseRedirect(run_url(run))
    elif request.method == "POST":
        form = ResolutionForm(request.POST)
        confirming = form.is_valid() and "_edit" not in request.POST
    else:
        head = LedgerEntry.objects.filter(run=run).order_by("-id").first()
        form = ResolutionForm(
            initial={"seen_ledger_id": head.pk if head else 0, "step": run.attention_step}
        )

    # Only the step in doubt: a run may have thousands of entries on other steps.
    ledger = list(LedgerEntry.objects.filter(run=run, seq=run.attention_step).order_by("id"))
    name = naming.described_name(run.workflow_name, run.task_path)
    title = f"Resolve step {run.attention_step} of {name}"
    context = _admin_context(
        model_admin,
        request,
        title=("Confirm: " if confirming else "") + title,
        subtitle=str(run.pk),
        run=run,
        original=run,
        form=form,
        confirming=confirming,
        decision_label=dict(DECISION_CHOICES).get(form.cleaned_data.get("decision", ""))
        if confirming
        else "",
        dispatch=incident_dispatch(run, ledger),
        answers=incident_answers(run, ledger),
        effect_key=effect_key_shown(run),
        call_arguments=pretty_json(call_arguments(run)),
        incident_story=story_of(run),
        run_url=run_url(run),
        queue_url=reverse("admin:k2b_workflows_incident_changelist"),
    )
    return TemplateResponse(request, "admin/k2b_workflows/resolve.html", context)


def resolution_message(step: int | None, decision: str, evidence: str) -> str:
    """The admin log's message for a resolution; ``manage.py workflowrun resolve`` writes it too."""
    label = dict(DECISION_CHOICES)[decision].split(":")[0]
    return f"Resolved step {step} ({label.lower()}): {evidence}"


def _apply_resolution(
    model_admin: ModelAdmin, request: HttpRequest, run: WorkflowRun, form: ResolutionForm
) -> HttpResponse | None:
    data = form.cleaned_data
    decision = data["decision"]
    try:
        # The step and the evidence version are compared under the run lock.
        resolved = resolve_effect(
            run.pk,
            decision,
            evidence=data["evidence"],
            actor=request.user,
            output=data["output_value"] if decision == EFFECT_CONFIRMED else None,
            step=data["step"],
            seen_ledger_id=data["seen_ledger_id"],
        )
    except EvidenceChanged as exc:
        head = exc.head
        messages.warning(
            request,
            "New evidence arrived for this run since the form was shown "
            f"(ledger entry {head.pk}: {head.kind}). Nothing changed; review it and "
            "decide again.",
        )
        return HttpResponseRedirect(request.path)
    except ResolutionRefused as exc:
        current = WorkflowRun.objects.get(pk=run.pk)
        if current.status == RunStatus.NEEDS_ATTENTION and current.attention_step is not None:
            messages.error(request, f"Nothing changed: {exc}.")
        else:
            messages.error(request, _refusal_message(run.pk))
        return HttpResponseRedirect(run_url(run))
    except InvalidInput as exc:
        form.add_error(None, str(exc))
        return None
    label = dict(DECISION_CHOICES)[decision].split(":")[0]
    model_admin.log_change(
        request, resolved, resolution_message(run.attention_step, decision, data["evidence"])
    )
    after = (
        "the run continues with the confirmed output"
        if decision == EFFECT_CONFIRMED
        else "the step will run again under a new invocation key"
    )
    messages.success(
        request,
        f"Step {run.attention_step} of run {run.pk}: {label.lower()} recorded; {after}. "
        f"The run is {resolved.status}.",
    )
    return HttpResponseRedirect(run_url(resolved))


# Cancel and retry -------------------------------------------------------------------------


def _can_cancel(run: WorkflowRun) -> str:
    if run.status in TERMINAL_STATUSES:
        return f"already {run.status}"
    return "its cancel was already requested" if run.cancel_requested_at else ""


def _can_retry(run: WorkflowRun) -> str:
    return retry_refusal(run)


#: The most runs one operation acts on: a filtered selection ("select all 40,213")
#: is refused past it, with the count, rather than acted on for minutes in one request.
MAX_SELECTED = 1000


def _can_fork_from_failure(run: WorkflowRun) -> str:
    """Why "fork from failure" skips ``run``: not failed, or an effect it would repeat
    (an operator forks such a run from its own page, naming the effect)."""
    if run.status != RunStatus.FAILED:
        return f"{run.status}, not failed"
    try:
        planned = fork_plan(run.pk, "failure")
    except InvalidInput as exc:
        return str(exc)
    if planned.at_risk:
        steps = ", ".join(f"step {s['seq']} ({s['action']})" for s in planned.at_risk)
        return f"would run again {steps}, whose effect may have happened: fork it from its page"
    return ""


#: At most this many runs are forked by one "fork from failure": each fork reads its
#: original's evidence, and a larger selection is a deploy's job, not a click's.
FORK_SELECTION_CAP = 100


def _can_cancel_call(run: WorkflowRun) -> str:
    if run.workflow_name not in EFFECT_OF_WORKFLOW:
        return "not a task call (Cancel selected runs cancels a workflow run)"
    if run.status in TERMINAL_STATUSES:
        return f"already {run.status}"
    return "its cancel was already requested" if run.cancel_requested_at else ""


#: At most this many task calls are canceled by one action (#49): a selection of a whole
#: filtered list is refused, not read into one page and one request.
MAX_CALLS_CANCELED = 500


@dataclass(frozen=True)
class Operation:
    """An operator's action on runs: who may do it, to which runs, and what it means."""

    title: str
    verb: str
    check: Callable[[WorkflowRun], str | None]  # why a run is skipped, or None
    permission: str
    explain: str
    #: At most this many runs per action; a larger selection is refused. None: no cap.
    cap: int | None = None


OPERATIONS = {
    "cancel": Operation(
        title="Cancel runs",
        verb="Cancel",
        check=_can_cancel,
        permission="k2b_workflows.cancel_workflowrun",
        explain="A queued or waiting run is canceled at once, with its children and AI "
        "tasks. A running run is asked to stop: its current step finishes and keeps its "
        "result and effect records (ctx.canceled tells the step), then no further step "
        "starts and the run ends canceled; its running children are asked alike.",
    ),
    "cancel_call": Operation(
        title="Cancel task calls",
        verb="Cancel",
        check=_can_cancel_call,
        permission="k2b_workflows.cancel_workflowrun",
        explain="A call that has not started never runs: it fails, canceled. A running "
        "call is asked to stop (is_cancel_requested, an async pure or idempotent task's "
        "CancelledError; an external call is never cut): if it still returns normally it "
        "succeeds, its work was done; if it raises it fails, canceled. No call is retried "
        "or run again after its cancel.",
        cap=MAX_CALLS_CANCELED,
    ),
    "retry": Operation(
        title="Retry runs now",
        verb="Retry now",
        check=_can_retry,
        permission="k2b_workflows.retry_workflowrun",
        explain="Runs that failed after exhausting their retries, and incidents whose cause "
        "is the code or the stored evidence (nondeterministic replay, an exception in the "
        "workflow code, a broken chain), are queued again with their failure count reset "
        "and replay their journal on the code running now. Deploy the fix or the patch "
        "(or restore the evidence) first: the same code stops at the same place. A task "
        "call that failed is called once more: one more attempt of the same call, its "
        "attempts counted on.",
    ),
    "reenqueue": Operation(
        title="Re-enqueue runs",
        verb="Re-enqueue",
        check=reenqueue_refusal,
        permission="k2b_workflows.retry_workflowrun",
        explain="Each run is started again as a new run beside it, with the same input: a "
        "task call as a new call of its task with the same arguments and options, a workflow "
        "run on its workflow's newest version. The selected runs are not changed, whatever "
        "their state: re-enqueueing a run that is still queued or running makes two.",
    ),
    "fork": Operation(
        title="Fork runs from their failure",
        verb="Fork from failure",
        check=_can_fork_from_failure,
        permission=FORK_PERMISSION,
        explain="Each failed run gets a fork: a new run that keeps the results of the steps "
        "before the one that failed and runs that step and the rest on the code running now. "
        "The failed runs stay as they are, linked to their forks. A run whose later steps "
        "had an external effect is left out: fork it from its own page. Deploy the fix first.",
    ),
}


def _apply(operation: str, request: HttpRequest, run: WorkflowRun, reason: str) -> None:
    if operation == "cancel":
        cancel_workflow_run(run.pk, f"{reason} (by {request.user.get_username()})")
    elif operation == "reenqueue":
        new = reenqueue_workflow_run(run.pk, actor=request.user)
        messages.info(request, f"Run {run.pk} re-enqueued as run {new.pk}.")
    elif operation == "fork":
        fork_workflow_run(run.pk, from_step="failure", actor=request.user, reason=reason)
    elif operation == "cancel_call":
        from ..tasks.cancels import cancel

        cancel(run.pk, f"{reason} (by {request.user.get_username()})")
    else:
        retried = retry_workflow_run(run.pk, actor=request.user, reason=reason)
        # The words ``workflowrun retry`` prints for the same retry.
        messages.success(request, retry_words(retried))


def confirm_operation(
    model_admin: ModelAdmin,
    request: HttpRequest,
    queryset: QuerySet[WorkflowRun],
    operation: str,
    *,
    action_name: str = "",
) -> HttpResponse | None:
    """A confirmation page, like "delete selected", then cancel or retry each run.

    Used by the changelist actions (``action_name`` set) and by the buttons on
    a run's page. Returns ``None`` once done, so the changelist redirects.
    """
    spec = OPERATIONS[operation]
    # Acting on runs one may not see would be acting blind: view permission too.
    if not request.user.has_perm(spec.permission) or not can_view_runs(request):
        raise PermissionDenied
    selected = queryset.count()
    if selected > MAX_SELECTED:
        messages.error(
            request,
            f"{spec.verb}: {selected:,} runs are selected, and one operation acts on at most"
            f" {MAX_SELECTED:,}. Nothing was done: narrow the selection with the filters.",
        )
        return None
    if operation == "fork" and selected > FORK_SELECTION_CAP:
        messages.error(
            request,
            f"Fork from failure takes at most {FORK_SELECTION_CAP} runs at a time: "
            "filter the list further. Nothing was forked.",
        )
        return None
    if spec.cap is not None and selected > spec.cap:
        messages.error(
            request,
            f"{spec.title}: more than {spec.cap} runs selected; nothing was done. "
            "Narrow the selection with a filter.",
        )
        return None
    runs = list(queryset.order_by("created_at"))
    checked = [(run, spec.check(run)) for run in runs]  # once: a fork's check reads evidence
    eligible = [run for run, why in checked if not why]
    skipped = [(run, why) for run, why in checked if why]
    form = ReasonForm(request.POST if request.POST.get("post") == "yes" else None)
    if form.is_bound and form.is_valid() and eligible:
        done = 0
        for run in eligible:
            try:
                _apply(operation, request, run, form.cleaned_data["reason"])
            except (NotRetryable, InvalidInput, ForkRefused) as exc:
                messages.error(request, f"Run {run.pk}: {exc}")
                continue
            model_admin.log_change(request, run, f"{spec.verb}: {form.cleaned_data['reason']}")
            done += 1
        if done:
            messages.success(request, f"{spec.verb}: {done} run(s).")
        return None
    context = _admin_context(
        model_admin,
        request,
        title=spec.title,
        operation=operation,
        spec=spec,
        form=form,
        eligible=eligible,
        skipped=skipped,
        action_name=action_name,
        action_checkbox_name=helpers.ACTION_CHECKBOX_NAME,
        cancel_url=(
            run_url(runs[0])
            if not action_name and runs
            else reverse("admin:k2b_workflows_workflowrun_changelist")
        ),
    )
    return TemplateResponse(request, "admin/k2b_workflows/confirm_operation.html", context)


def run_operation_view(
    model_admin: ModelAdmin, request: HttpRequest, object_id: str, operation: str
) -> HttpResponse:
    """The "Cancel…" and "Retry now…" buttons of a run's page."""
    queryset = WorkflowRun.objects.filter(pk=run_id_or_404(object_id))
    if not queryset.exists():
        raise Http404
    response = confirm_operation(model_admin, request, queryset, operation)
    return response or HttpResponseRedirect(run_url(object_id))


# Fork -------------------------------------------------------------------------------------


def _default_fork_step(run: WorkflowRun) -> str:
    return "failure" if run.status == RunStatus.FAILED else "0"


def _fork_step(value: str) -> int | str:
    """The ``step`` of the fork page's URL: a seq or "failure"; anything else is refused
    by the plan, which names the run's steps."""
    return int(value) if value.lstrip("-").isdigit() else value


def fork_view(model_admin: ModelAdmin, request: HttpRequest, object_id: str) -> HttpResponse:
    """ "Fork from this step": the effects the fork would repeat first, then the form.

    Shown for ``?step=N`` (or ``failure``); the fork itself plans again under the
    run's lock, so an effect recorded since the page was drawn still refuses it.
    """
    if not request.user.has_perm(FORK_PERMISSION) or not can_view_runs(request):
        raise PermissionDenied
    run = get_object_or_404(WorkflowRun, pk=run_id_or_404(object_id))
    source = request.POST if request.method == "POST" else request.GET
    step = _fork_step(str(source.get("step", _default_fork_step(run)))[:20])
    try:
        planned = fork_plan(run.pk, step)
    except InvalidInput as exc:
        messages.error(request, f"Not forked: {exc}")
        return HttpResponseRedirect(run_url(run))
    choices = [
        (s["seq"], f"step {s['seq']}: {s['action']} ({s['effect']}, {s['state']})")
        for s in planned.at_risk
    ] + [
        (e.seq, f"step {e.seq}: {e.action_name} (idempotent: a new key)")
        for e in planned.idempotent_steps()
        if e.seq not in {s["seq"] for s in planned.at_risk}
    ]
    form = ForkForm(request.POST if request.method == "POST" else None, steps=choices)
    if form.is_bound and form.is_valid():
        data = form.cleaned_data
        try:
            forked = fork_workflow_run(
                run.pk,
                from_step=planned.seq,
                actor=request.user,
                reason=data["reason"],
                repeat_effects=data["repeat_effects"],
            )
        except (ForkRefused, InvalidInput) as exc:
            form.add_error(None, str(exc))
        else:
            model_admin.log_change(
                request, run, f"Forked from step {planned.seq} as {forked.pk}: {data['reason']}"
            )
            messages.success(
                request,
                f"Run {run.pk} forked from step {planned.seq}: this is the fork, {forked.status}.",
            )
            return HttpResponseRedirect(run_url(forked))
    name = naming.described_name(run.workflow_name, run.task_path)
    context = _admin_context(
        model_admin,
        request,
        title=f"Fork {name} from step {planned.seq}",
        subtitle=str(run.pk),
        run=run,
        original=run,
        plan=planned,
        kept=planned.journal[: planned.seq],
        step_value=step,
        form=form,
        run_url=run_url(run),
    )
    return TemplateResponse(request, "admin/k2b_workflows/fork.html", context)


# Dry run ----------------------------------------------------------------------------------


def dry_run_view(model_admin: ModelAdmin, request: HttpRequest) -> HttpResponse:
    """Run a workflow with ``plan()`` in place of every effect and show the report."""
    if not request.user.has_perm("k2b_workflows.dry_run_workflow"):
        raise PermissionDenied
    report = None
    form = DryRunForm(request.POST or None)
    if form.is_bound and form.is_valid():
        try:
            report = dry_run(
                form.cleaned_data["workflow"],
                form.cleaned_data["input"],
                principal=form.cleaned_data["principal"],
            )
        except (UnknownWorkflow, InvalidInput) as exc:
            form.add_error(None, str(exc))
    units = sorted(set(report.cost) | set(report.budget)) if report else []
    context = _admin_context(
        model_admin,
        request,
        title="Dry run",
        form=form,
        report=report,
        # Outputs as JSON, as the workflow and the operator write them, not Python reprs.
        step_rows=[(step, json.dumps(redact(step.output), sort_keys=True)) for step in report.steps]
        if report
        else [],
        output_json=json.dumps(redact(report.output), indent=2, sort_keys=True) if report else "",
        budget_rows=[(unit, report.cost.get(unit, 0), report.budget.get(unit)) for unit in units]
        if report
        else [],
    )
    return TemplateResponse(request, "admin/k2b_workflows/dry_run.html", context)


# Concurrency keys --------------------------------------------------------------------------


def concurrency_key_view(model_admin: ModelAdmin, request: HttpRequest) -> HttpResponse:
    """One concurrency key: who holds its slots, and who is queued behind it, in line order."""
    if not can_view_runs(request):
        raise PermissionDenied
    workflow_name = request.GET.get("workflow", "")
    key = request.GET.get("key", "")
    if not workflow_name or not key:
        raise Http404("a key page needs ?workflow=...&key=...")
    for argument, value, longest in (("workflow", workflow_name, 200), ("key", key, 255)):
        # A NUL byte reached PostgreSQL and answered HTTP 500 (#35).
        if "\x00" in value or len(value) > longest:
            return HttpResponseBadRequest(
                f"?{argument}= must be at most {longest} characters, without NUL bytes"
            )
    view = flow.key_runs(settings.database(), workflow_name, key)
    with connection_for_runs().cursor() as cursor:
        busiest = flow.busiest_keys(cursor, limit=20)
    context = _admin_context(
        model_admin,
        request,
        title=f"Concurrency key {key!r} of {workflow_name}",
        key_view=view,
        active=[(row, run_url(row["id"])) for row in view["active"]],
        queued=[(row, run_url(row["id"])) for row in view["queued"]],
        busiest=[(row, concurrency_key_url(row["workflow_name"], row["key"])) for row in busiest],
    )
    return TemplateResponse(request, "admin/k2b_workflows/concurrency_key.html", context)


def connection_for_runs() -> BaseDatabaseWrapper:
    from django.db import connections

    return connections[settings.database()]
