"""What every page of the admin shows alike: status badges, hashes, JSON, read-only pages."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from django.contrib import messages
from django.db.models import Model
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.utils.html import format_html

from ..models import RunStatus
from ..redaction import redact, shorten

HASH_PREVIEW = 8


def status_badge(status: str) -> str:
    label = RunStatus(status).label if status in RunStatus.values else status
    return format_html('<span class="k2b-badge k2b-status-{}">{}</span>', status, label)


def short_hash(value: str) -> str:
    if not value:
        return "—"
    return format_html('<code class="k2b-hash" title="{}">{}…</code>', value, value[:HASH_PREVIEW])


#: Strings in JSON shown on a page are cut to this many characters, and the
#: whole value to ``MAX_JSON_SHOWN`` (the database keeps them whole).
MAX_STRING_SHOWN = 2_000
MAX_JSON_SHOWN = 200_000


def pretty_json(value: Any) -> str:
    """A JSON value as the admin shows it: redacted (passwords, tokens, card numbers), bounded."""
    shown = redact(shorten(value, MAX_STRING_SHOWN))
    text = json.dumps(shown, indent=2, sort_keys=True, ensure_ascii=False)
    if len(text) > MAX_JSON_SHOWN:
        text = (
            f"{text[:MAX_JSON_SHOWN]}\n… [{len(text) - MAX_JSON_SHOWN} more characters not shown]"
        )
    return format_html('<pre class="k2b-json">{}</pre>', text)


def field_names(fieldsets: Sequence[tuple[str | None, Mapping[str, Any]]]) -> tuple[str, ...]:
    """Every field the fieldsets show, in order, rows of several fields flattened."""
    names: list[str] = []
    for _, options in fieldsets:
        for field in options["fields"]:
            names.extend([field] if isinstance(field, str) else field)
    return tuple(names)


class ReadOnlyMixin:
    """Journal, ledger and runs are never added, edited or deleted from the admin.

    Their lists refuse a NUL character in a filter or search: PostgreSQL cannot
    compare text with one, and the error would be a 500 instead of an answer.
    """

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if any("\x00" in value for values in request.GET.lists() for value in values[1]):
            messages.error(request, "A filter or search contained a NUL character; ignored.")
            return HttpResponseRedirect(request.path)
        return super().changelist_view(request, extra_context)  # type: ignore[misc]

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False
