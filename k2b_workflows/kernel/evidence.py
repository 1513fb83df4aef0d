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
from .db import lease_lost

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


_FENCED_JOURNAL_SQL = """
WITH fenced AS (
    UPDATE k2b_run
       SET lease_expires_at = statement_timestamp() + %s * interval '1 millisecond',
           updated_at = now(), current_step = %s, consecutive_failures = 0
     WHERE id = %s AND generation = %s AND status = 'running'
    RETURNING id)
INSERT INTO k2b_journal (run_id, seq, action_name, effect, state, output, summary, error_code,
                         error_message, input_hash, generation, started_at, created_at,
                         prev_hash, entry_hash)
SELECT id, %s, %s, %s, %s, %s::jsonb, %s, %s, %s, %s, %s, %s, %s, %s, %s FROM fenced
RETURNING id
"""


def append_journal_fenced(
    entry: JournalEntry, prev_hash: str, using: str, *, lease_ms: int
) -> JournalEntry:
    """Fence the run and insert the journal entry in one statement (no surrounding transaction).

    The UPDATE in the statement takes the run row lock and checks the
    generation (re-checked on the newest row version if a takeover committed
    meanwhile), and the INSERT reads its row from that UPDATE: a fenced-out
    worker inserts nothing. One statement in autocommit is one round trip and
    one commit, where fence + insert in a transaction are four round trips.
    Raises ``LeaseLost`` or ``RunCanceled`` when the run is no longer ours.
    """
    entry.prev_hash = prev_hash
    entry.entry_hash = journal_hash(prev_hash, entry)
    params = [
        lease_ms,
        entry.seq,
        entry.run_id,
        entry.generation,
        entry.seq,
        entry.action_name,
        entry.effect,
        entry.state,
        None if entry.output is None else canonical_json(entry.output),
        entry.summary,
        entry.error_code,
        entry.error_message,
        entry.input_hash,
        entry.generation,
        entry.started_at,
        entry.created_at,
        entry.prev_hash,
        entry.entry_hash,
    ]
    with connections[using].cursor() as cursor:
        cursor.execute(_FENCED_JOURNAL_SQL, params)
        row = cursor.fetchone()
    if row is None:
        raise lease_lost(using, entry.run_id, entry.generation)
    entry.pk = row[0]
    entry._state.adding = False
    entry._state.db = using
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
