"""Forms of the operators' admin screens: resolving an incident, cancel, retry, dry run.

Every form validates everything before anything is called: a malformed
output or an empty evidence text is a form error, and the run stays as it is.
"""

from __future__ import annotations

import json
from typing import Any, cast

from django import forms
from django.core.exceptions import ValidationError

from .. import validation
from ..control import EFFECT_ABSENT, EFFECT_CONFIRMED
from ..exceptions import InvalidInput
from ..workflows import registered_workflows

DECISION_CHOICES = [
    (EFFECT_ABSENT, "Effect absent: it did not happen, run the step again"),
    (EFFECT_CONFIRMED, "Effect confirmed: it happened, continue with this output"),
]


#: Bounds of a JSON value typed into an admin form. Far above any real output or
#: input, far below what would tie up a web process or overflow Python's stack.
MAX_JSON_CHARS = 1_000_000
MAX_JSON_DEPTH = 64
MAX_EVIDENCE_CHARS = 20_000


def _depth_and_nul(value: Any, what: str) -> None:
    """Refuse values nested deeper than ``MAX_JSON_DEPTH`` or holding a NUL character.

    PostgreSQL's jsonb cannot store ``\\u0000``, and a deep value would overflow
    the stack of whatever walks it next: both are form errors here, not a 500 later.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValidationError(
                "%(what)s is nested more than %(max)d levels deep.",
                code="too_deep",
                params={"what": what, "max": MAX_JSON_DEPTH},
            )
        if isinstance(item, str) and "\x00" in item:
            raise ValidationError(
                "%(what)s contains a NUL character (\\u0000), which cannot be stored.",
                code="nul",
                params={"what": what},
            )
        if isinstance(item, dict):
            stack.extend((k, depth) for k in item)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def _parse_json(text: str, what: str) -> Any:
    if len(text) > MAX_JSON_CHARS:
        raise ValidationError(
            "%(what)s is %(size)d characters long; at most %(max)d are accepted here.",
            code="too_long",
            params={"what": what, "size": len(text), "max": MAX_JSON_CHARS},
        )
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValidationError(
            "%(what)s is not valid JSON: %(error)s",
            code="invalid_json",
            params={"what": what, "error": exc},
        ) from exc
    except RecursionError as exc:  # the parser's own stack: nested thousands deep
        raise ValidationError(
            "%(what)s is nested more than %(max)d levels deep.",
            code="too_deep",
            params={"what": what, "max": MAX_JSON_DEPTH},
        ) from exc
    except ValueError as exc:  # an integer past Python's digit limit for int(str)
        raise ValidationError(
            "%(what)s holds a number JSON here cannot take: %(error)s",
            code="invalid_number",
            params={"what": what, "error": exc},
        ) from exc
    _depth_and_nul(value, what)
    try:
        validation.check_json(value, what)
    except InvalidInput as exc:
        raise ValidationError(str(exc), code="invalid_json") from exc
    return value


class ResolutionForm(forms.Form):
    """An operator's decision on one ambiguous effect.

    ``seen_ledger_id`` is the newest ledger entry the operator was shown and
    ``step`` the step the decision is about; both are required: a decision
    taken on evidence that has since changed (another operator resolved, the
    step ran again, a late result arrived), or about another step, is refused.
    """

    decision = forms.ChoiceField(choices=DECISION_CHOICES, widget=forms.RadioSelect)
    evidence = forms.CharField(
        max_length=MAX_EVIDENCE_CHARS,
        widget=forms.Textarea(attrs={"rows": 4, "cols": 60}),
        help_text="What you checked and found, e.g. the provider's dashboard entry. "
        "Kept in the ledger with your name.",
    )
    output = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 4, "cols": 60, "class": "vLargeTextField"}),
        label="Output (JSON)",
        help_text='For "effect confirmed": the step\'s result as the provider reported it, '
        'e.g. {"charge_id": "ch_123"}. Ignored for "effect absent".',
    )
    # Required, but checked in clean(): a hidden field's own error is never shown.
    seen_ledger_id = forms.IntegerField(widget=forms.HiddenInput, required=False, min_value=0)
    step = forms.IntegerField(widget=forms.HiddenInput, required=False, min_value=0)

    def clean_evidence(self) -> str:
        evidence = self.cleaned_data["evidence"].strip()
        if not evidence:
            raise ValidationError("Evidence is required.", code="required")
        return evidence

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        hidden = ("seen_ledger_id", "step")
        if any(name in self.errors or data.get(name) is None for name in hidden):
            for name in hidden:
                self.errors.pop(name, None)
            raise ValidationError(
                "This decision does not say which evidence and which step it was taken on "
                "(seen_ledger_id and step are required). Nothing changed: reload the "
                "incident, review its evidence and decide again.",
                code="stale_form",
            )
        if data.get("decision") == EFFECT_CONFIRMED:
            text = (data.get("output") or "").strip()
            if not text:
                self.add_error("output", "A confirmed effect needs the step's output as JSON.")
            else:
                try:
                    data["output_value"] = _parse_json(text, "The output")
                except ValidationError as exc:
                    self.add_error("output", exc)
        else:
            data["output_value"] = None
        return data


class SettleForm(forms.Form):
    """One decision for several incidents at once: one outcome, one evidence text.

    As ``ResolutionForm``, less the hidden step and evidence version: the page
    that confirms it carries one of each per run (``settle.seen_tokens``).
    """

    decision = forms.ChoiceField(choices=DECISION_CHOICES, widget=forms.RadioSelect)
    evidence = ResolutionForm.base_fields["evidence"]
    output = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 4, "cols": 60, "class": "vLargeTextField"}),
        label="Output (JSON)",
        help_text='For "effect confirmed": the result every selected step continues with, '
        'e.g. {"charged": true}. Ignored for "effect absent".',
    )

    clean_evidence = ResolutionForm.clean_evidence

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        data["output_value"] = None
        if data.get("decision") == EFFECT_CONFIRMED:
            text = (data.get("output") or "").strip()
            if not text:
                self.add_error("output", "A confirmed effect needs the steps' output as JSON.")
            else:
                try:
                    data["output_value"] = _parse_json(text, "The output")
                except ValidationError as exc:
                    self.add_error("output", exc)
        return data


class ReasonForm(forms.Form):
    """The reason an operator gives for cancelling or retrying runs (kept in the ledger)."""

    reason = forms.CharField(
        max_length=500,
        widget=forms.TextInput(attrs={"size": 60}),
        help_text="Recorded in the ledger with your name.",
    )

    def clean_reason(self) -> str:
        reason = self.cleaned_data["reason"].strip()
        if not reason:
            raise ValidationError("A reason is required.", code="required")
        return reason


class ForkForm(ReasonForm):
    """Why a run is forked, and which effects the operator allows to run again."""

    reason = forms.CharField(
        max_length=2000,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        help_text="Recorded in the fork's ledger and the original's, with your name.",
    )
    repeat_effects = forms.TypedMultipleChoiceField(
        choices=(),
        coerce=int,
        required=False,
        widget=forms.CheckboxSelectMultiple,
        label="Run again",
        help_text="Checked: the step runs again in the fork, a new call under a new key. "
        "An external step that may have happened must be checked, or the fork is refused.",
    )

    def __init__(self, *args: Any, steps: list[tuple[int, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cast("forms.TypedMultipleChoiceField", self.fields["repeat_effects"]).choices = steps


class DryRunForm(forms.Form):
    """A workflow name and its input: what a dry run needs."""

    workflow = forms.ChoiceField(choices=())
    input = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 6, "cols": 60, "class": "vLargeTextField"}),
        label="Input (JSON)",
        initial="{}",
    )
    principal = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2, "cols": 60}),
        label="Principal (JSON)",
        help_text="Optional access context, as given to start_workflow_run(principal=...).",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        workflow = self.fields["workflow"]
        assert isinstance(workflow, forms.ChoiceField)
        workflow.choices = [(name, name) for name in sorted(registered_workflows())]

    def clean_input(self) -> Any:
        return _parse_json(self.cleaned_data["input"], "The input")

    def clean_principal(self) -> Any:
        text = (self.cleaned_data.get("principal") or "").strip()
        return _parse_json(text, "The principal") if text else None
