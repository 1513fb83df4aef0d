"""Forms of the operators' admin screens: resolving an incident, cancel, retry, dry run.

Every form validates everything before anything is called: a malformed
output or an empty evidence text is a form error, and the run stays as it is.
"""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.core.exceptions import ValidationError

from .control import EFFECT_ABSENT, EFFECT_CONFIRMED
from .workflows import registered_workflows

DECISION_CHOICES = [
    (EFFECT_ABSENT, "Effect absent: it did not happen, run the step again"),
    (EFFECT_CONFIRMED, "Effect confirmed: it happened, continue with this output"),
]


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValidationError(
            "%(what)s is not valid JSON: %(error)s",
            code="invalid_json",
            params={"what": what, "error": exc},
        ) from exc


class ResolutionForm(forms.Form):
    """An operator's decision on one ambiguous effect.

    ``seen_ledger_id`` is the newest ledger entry the operator was shown: a
    decision taken on evidence that has since changed (another operator
    resolved, the step ran again, a late result arrived) is refused.
    """

    decision = forms.ChoiceField(choices=DECISION_CHOICES, widget=forms.RadioSelect)
    evidence = forms.CharField(
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
    seen_ledger_id = forms.IntegerField(widget=forms.HiddenInput, required=False)

    def clean_evidence(self) -> str:
        evidence = self.cleaned_data["evidence"].strip()
        if not evidence:
            raise ValidationError("Evidence is required.", code="required")
        return evidence

    def clean(self) -> dict[str, Any]:
        data = super().clean()
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
        self.fields["workflow"].choices = [(name, name) for name in sorted(registered_workflows())]

    def clean_input(self) -> Any:
        return _parse_json(self.cleaned_data["input"], "The input")

    def clean_principal(self) -> Any:
        text = (self.cleaned_data.get("principal") or "").strip()
        return _parse_json(text, "The principal") if text else None
