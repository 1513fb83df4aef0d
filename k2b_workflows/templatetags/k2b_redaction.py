"""Template filters that keep secrets off the operators' screens (see ``redaction``)."""

from __future__ import annotations

import json
from typing import Any

from django import template

from .. import redaction

register = template.Library()


@register.filter
def redact_text(value: Any) -> Any:
    """A message, key or summary with credentials and card numbers removed."""
    return redaction.redact_text(value)


@register.filter
def redact_json(value: Any) -> str:
    """A JSON value, redacted, as indented JSON text."""
    return json.dumps(redaction.redact(value), indent=2, sort_keys=True)
