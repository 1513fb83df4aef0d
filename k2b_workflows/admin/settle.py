"""Settling several incidents at once: one outcome, one evidence text, each run on its own.

The failure this is built around: a deploy or a provider outage leaves forty
charges in doubt, the operator checks them all on the provider's dashboard,
and then has to open forty resolve forms. A bulk action that wrote one
decision for all of them in one statement would lose what makes a single
resolution safe: its own ledger entry and seal, its own audit line, and the
check, under the run's lock, that the evidence the operator saw is still the
newest. So each selected run goes through ``control.resolve_effect`` exactly as
the single form does, with the step and the ledger head the confirmation page
showed for that run; a run that changed meanwhile is refused alone and named.

Bounded: at most ``MAX_SETTLE`` runs a decision, said on the page; a selection
above it resolves nothing. Runs that are not waiting for a decision on an
effect are listed as skipped, with why. A malformed form (no evidence, an
output that is not JSON, a confirmation that does not name each run's step
and evidence) resolves nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.contrib import messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.template.response import TemplateResponse
from django.urls import reverse

from ..control import EFFECT_CONFIRMED, RESOLVABLE_CODES, resolve_effect
from ..exceptions import EvidenceChanged, InvalidInput, ResolutionRefused
from ..models import LedgerEntry, RunStatus, WorkflowRun
from .common import pretty_json
from .display import bounded_input, call_arguments
from .forms import DECISION_CHOICES, SettleForm
from .views import RESOLVE_PERMISSION, _admin_context, can_view_runs, resolution_message

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin
    from django.db.models import QuerySet
    from django.http import HttpRequest, HttpResponse

#: The most runs one decision settles: enough for an outage's worth of calls, few
#: enough that an operator reads the list they confirm.
MAX_SETTLE = 100


def settle_refusal(run: WorkflowRun) -> str:
    """Why ``run`` is not settled by a decision on its effect ("" when it is)."""
    if run.status != RunStatus.NEEDS_ATTENTION:
        return f"it is {run.status}, not waiting for a decision"
    if run.error_code not in RESOLVABLE_CODES or run.attention_step is None:
        return (
            f"its incident ({run.error_code or 'no code'}) is not about an effect: "
            "its actions are on its page"
        )
    return ""


@dataclass(frozen=True)
class Seen:
    """What the confirmation page showed of one run: the step and the newest ledger entry."""

    run_id: uuid.UUID
    step: int
    ledger_id: int

    @property
    def token(self) -> str:
        return f"{self.run_id}:{self.step}:{self.ledger_id}"


def seen_now(run: WorkflowRun) -> Seen:
    head = LedgerEntry.objects.filter(run=run).order_by("-id").values_list("id", flat=True)
    assert run.attention_step is not None  # settle_refusal passed
    return Seen(run.pk, run.attention_step, head.first() or 0)


def seen_tokens(
    tokens: list[str], runs: Sequence[WorkflowRun], selected: set[str]
) -> dict[uuid.UUID, Seen]:
    """The step and evidence version the page showed for each of ``runs``.

    Raises ``InvalidInput`` naming what is wrong when a token is malformed, names
    a run that was not selected, or one of ``runs`` has none: then nothing is
    done. A token of a selected run that is no longer among ``runs`` (settled
    meanwhile) is kept: that run is named as left alone.
    """
    wanted = {run.pk for run in runs}
    seen: dict[uuid.UUID, Seen] = {}
    for token in tokens:
        parts = token.split(":")
        try:
            run_id, step, ledger_id = uuid.UUID(parts[0]), int(parts[1]), int(parts[2])
            if len(parts) != 3 or step < 0 or ledger_id < 0:
                raise ValueError(token)
        except (ValueError, IndexError):
            raise InvalidInput(
                f"the confirmation names a run's step and evidence as {token[:80]!r}; "
                "expected RUN_ID:STEP:LEDGER_ID"
            ) from None
        if str(run_id) not in selected and run_id not in wanted:
            raise InvalidInput(f"the confirmation names run {run_id}, which is not selected")
        seen[run_id] = Seen(run_id, step, ledger_id)
    missing = wanted - set(seen)
    if missing:
        raise InvalidInput(
            f"the confirmation does not say which step and evidence of run {min(missing)} "
            "were shown"
        )
    return seen


def settle_incidents(
    model_admin: ModelAdmin,
    request: HttpRequest,
    queryset: QuerySet[WorkflowRun],
    *,
    action_name: str,
) -> HttpResponse | None:
    """The changelist action: the form, its confirmation page, then one resolution a run.

    ``request.POST["post"]``: absent on the action's first call (the form),
    "form" once the form is filled (its confirmation page), "yes" once confirmed.
    Returns ``None`` when done, so the changelist redirects to itself.
    """
    if not request.user.has_perm(RESOLVE_PERMISSION) or not can_view_runs(request):
        raise PermissionDenied
    selected = queryset.count()
    # The arguments shown: only inputs stored small, as the incident queue reads them.
    bounded = queryset.annotate(call_input=bounded_input())
    runs = list(bounded.order_by("updated_at", "created_at")[: MAX_SETTLE + 1])
    eligible = [run for run in runs if not settle_refusal(run)]
    skipped = [(run, settle_refusal(run)) for run in runs if settle_refusal(run)]
    stage = request.POST.get("post", "")
    form = SettleForm(request.POST if stage in ("form", "yes") else None)
    errors: list[str] = []
    confirming = False
    if selected > MAX_SETTLE:
        errors.append(
            f"{selected} runs are selected; at most {MAX_SETTLE} are settled at once. "
            "Nothing changed: narrow the selection (a filter) and settle them in parts."
        )
    elif form.is_bound and form.is_valid() and eligible:
        if stage == "yes":
            try:
                seen = seen_tokens(
                    request.POST.getlist("seen"),
                    eligible,
                    set(request.POST.getlist(helpers.ACTION_CHECKBOX_NAME)),
                )
            except InvalidInput as exc:
                errors.append(f"Nothing changed: {exc}.")
            else:
                _settle(model_admin, request, eligible, seen, form.cleaned_data)
                return None
        else:
            confirming = True
    shown = {run.pk: seen_now(run) for run in eligible} if confirming else {}
    context = _admin_context(
        model_admin,
        request,
        title=("Confirm: settle " if confirming else "Settle ")
        + f"{len(eligible)} incident{'s' if len(eligible) != 1 else ''}",
        form=form,
        confirming=confirming,
        errors=errors,
        cap=MAX_SETTLE,
        selected=selected,
        eligible=[(run, _arguments(run), shown.get(run.pk)) for run in eligible],
        skipped=skipped,
        decision_label=dict(DECISION_CHOICES).get(form.cleaned_data.get("decision", ""))
        if confirming
        else "",
        action_name=action_name,
        action_checkbox_name=helpers.ACTION_CHECKBOX_NAME,
        cancel_url=reverse("admin:k2b_workflows_incident_changelist"),
    )
    return TemplateResponse(request, "admin/k2b_workflows/settle_incidents.html", context)


def _arguments(run: WorkflowRun) -> str:
    """The call's arguments, redacted; a large input is on the run's page only."""
    value = getattr(run, "call_input", None)
    if value is None:
        return "too large for a list: see the run"
    return pretty_json(call_arguments(run, value))


def _settle(
    model_admin: ModelAdmin,
    request: HttpRequest,
    runs: Sequence[WorkflowRun],
    seen: dict[uuid.UUID, Seen],
    data: dict[str, Any],
) -> None:
    """Each run through ``resolve_effect`` on its own: its own lock, ledger entry, seal
    and audit line; one refused (another operator first, new evidence) stops no other."""
    decision = data["decision"]
    done = 0
    for run_id in sorted(set(seen) - {run.pk for run in runs}):
        messages.warning(
            request,
            f"Run {run_id}: no longer waiting for a decision since the confirmation was "
            "shown; left as it is.",
        )
    for run in runs:
        shown = seen[run.pk]
        try:
            resolved = resolve_effect(
                run.pk,
                decision,
                evidence=data["evidence"],
                actor=request.user,
                output=data["output_value"] if decision == EFFECT_CONFIRMED else None,
                step=shown.step,
                seen_ledger_id=shown.ledger_id,
            )
        except EvidenceChanged as exc:
            messages.warning(
                request,
                f"Run {run.pk}: new evidence arrived since the confirmation was shown (ledger "
                f"entry {exc.head.pk}: {exc.head.kind}); not settled, review it on its own.",
            )
            continue
        except (ResolutionRefused, InvalidInput) as exc:
            messages.error(request, f"Run {run.pk}: not settled: {exc}.")
            continue
        model_admin.log_change(
            request, resolved, resolution_message(shown.step, decision, data["evidence"])
        )
        done += 1
    if done:
        label = dict(DECISION_CHOICES)[decision].split(":")[0].lower()
        messages.success(request, f"{label} recorded for {done} run(s), each in its own ledger.")
