"""Hashing, the append-only journal and ledger, and their hash chains.

Every checkpoint of a run chains to the previous one:
``entry_hash = sha256(prev_hash ‖ canonical(entry))``. The chain is verified
before a run's success commits; a row changed behind the kernel's back (the
triggers refuse it, but a superuser can disable triggers) breaks it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from django.db import connections

from ..actions import canonical_json
from ..models import JournalEntry, LedgerEntry

GENESIS = "0" * 64


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def hash_value(value: Any) -> str:
    """Hash of a JSON value's canonical text (inputs, principals, previews)."""
    return sha256_hex(canonical_json(value))


def hash_optional(value: str | None) -> str:
    return sha256_hex(value) if value else ""


_JOURNAL_FIELDS = (
    "run_id",
    "seq",
    "action_name",
    "effect",
    "state",
    "output",
    "error_code",
    "error_message",
    "input_hash",
    "generation",
)
_LEDGER_FIELDS = (
    "run_id",
    "seq",
    "kind",
    "action_name",
    "effect",
    "invocation_key",
    "effect_key",
    "generation",
    "definition_hash",
    "input_hash",
    "preview_hash",
    "principal_hash",
    "idempotency_key_hash",
    "output_hash",
    "message",
    "actor",
    "actor_id",
    "evidence",
    "detail",
)


def _entry_hash(prev_hash: str, entry: Any, fields: Iterable[str]) -> str:
    body = {name: getattr(entry, name) for name in fields}
    body["run_id"] = str(body["run_id"])
    return sha256_hex(prev_hash + canonical_json(body))


def journal_hash(prev_hash: str, entry: JournalEntry) -> str:
    return _entry_hash(prev_hash, entry, _JOURNAL_FIELDS)


def ledger_hash(prev_hash: str, entry: LedgerEntry) -> str:
    return _entry_hash(prev_hash, entry, _LEDGER_FIELDS)


def append_journal(entry: JournalEntry, prev_hash: str, using: str) -> JournalEntry:
    """Insert a journal entry chained to ``prev_hash``. Caller holds the run lock."""
    entry.prev_hash = prev_hash
    entry.entry_hash = journal_hash(prev_hash, entry)
    entry.save(using=using, force_insert=True)
    return entry


def append_ledger(using: str, **fields: Any) -> LedgerEntry:
    """Append a ledger entry to the run's chain. Caller holds the run row lock."""
    entry = LedgerEntry(**fields)
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT entry_hash FROM k2b_ledger WHERE run_id = %s ORDER BY id DESC LIMIT 1",
            [entry.run_id],
        )
        row = cursor.fetchone()
    entry.prev_hash = row[0] if row else GENESIS
    entry.entry_hash = ledger_hash(entry.prev_hash, entry)
    entry.save(using=using, force_insert=True)
    return entry


def verify_chains(run_id: Any, using: str) -> str | None:
    """Re-read the run's journal and ledger from the database and check both chains.

    Returns a description of the first break, or None when both are intact.
    """
    for model, hasher, order in (
        (JournalEntry, journal_hash, "seq"),
        (LedgerEntry, ledger_hash, "id"),
    ):
        prev = GENESIS
        for entry in model.objects.using(using).filter(run_id=run_id).order_by(order):
            if entry.prev_hash != prev:
                return f"{model.__name__} {entry.pk}: prev_hash does not match the previous entry"
            if hasher(prev, entry) != entry.entry_hash:
                return f"{model.__name__} {entry.pk}: contents do not match entry_hash"
            prev = entry.entry_hash
    return None
