"""The journal and the ledger in the admin: append-only evidence, shown read-only and redacted.

An entry's free texts and outputs are shown through ``redact``/``redact_text``,
never raw: a provider's message may hold what an operator must not see.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.contrib import admin
from django.db.models import Model, QuerySet
from django.http import HttpRequest

from ..models import JournalEntry, LedgerEntry
from ..redaction import redact_text
from .common import ReadOnlyMixin, pretty_json


class _EntryAdmin(ReadOnlyMixin, admin.ModelAdmin):
    list_select_related = ("run",)
    list_per_page = 100
    show_full_result_count = False
    #: Fields shown through ``redact``/``redact_text`` on an entry's page, never raw.
    redacted_fields: tuple[str, ...] = ()

    #: Large JSON columns the list never shows.
    list_defer: tuple[str, ...] = ()

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        # The "run" column joins the run row: never its JSON bodies (10 MB inputs
        # times a page of entries), nor the entry's own large columns.
        queryset = super().get_queryset(request).select_related("run")
        return queryset.defer("run__input", "run__output", "run__principal", *self.list_defer)

    def get_fields(self, request: HttpRequest, obj: Model | None = None) -> Any:
        return [
            f"{name}_shown" if name in self.redacted_fields else name
            for name in super().get_fields(request, obj)
        ]

    def get_readonly_fields(
        self, request: HttpRequest, obj: Model | None = None
    ) -> tuple[str, ...]:
        return (*super().get_readonly_fields(request, obj), *self._shown_names())

    def _shown_names(self) -> tuple[str, ...]:
        return tuple(f"{name}_shown" for name in self.redacted_fields)

    @admin.display(description="output")
    def output_shown(self, entry: Any) -> str:
        return pretty_json(entry.output) if entry.output is not None else "—"

    @admin.display(description="detail")
    def detail_shown(self, entry: Any) -> str:
        return pretty_json(entry.detail) if entry.detail is not None else "—"

    @admin.display(description="message")
    def message_shown(self, entry: Any) -> str:
        return redact_text(entry.message) or "—"

    @admin.display(description="error message")
    def error_message_shown(self, entry: Any) -> str:
        return redact_text(entry.error_message) or "—"

    @admin.display(description="summary")
    def summary_shown(self, entry: Any) -> str:
        return redact_text(entry.summary) or "—"

    @admin.display(description="evidence")
    def evidence_shown(self, entry: Any) -> str:
        return redact_text(entry.evidence) or "—"

    class Media:
        css = {"all": ["k2b_workflows/admin.css"]}

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        try:
            return queryset.filter(run_id=uuid.UUID(search_term.strip())), False
        except ValueError:
            return super().get_search_results(request, queryset, search_term)


@admin.register(JournalEntry)
class JournalEntryAdmin(_EntryAdmin):
    list_display = ("run", "seq", "action_name", "effect", "state", "error_code", "created_at")
    list_filter = ("state", "effect", "action_name")
    redacted_fields = ("output", "error_message", "summary")
    search_fields = ("action_name",)
    search_help_text = "Run id (full) or action name."


@admin.register(LedgerEntry)
class LedgerEntryAdmin(_EntryAdmin):
    list_display = (
        "run",
        "seq",
        "kind",
        "action_name",
        "effect",
        "generation",
        "invocation_key",
        "actor",
        "created_at",
    )
    list_filter = ("kind", "effect", "action_name")
    redacted_fields = ("detail", "message", "evidence")
    search_fields = ("action_name", "invocation_key", "actor")
    search_help_text = "Run id (full), action name, invocation key or operator."
