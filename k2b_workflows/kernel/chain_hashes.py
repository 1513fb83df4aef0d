"""The hashes of the evidence chains: an entry's keyed hash and the run row's anchor.

Kept apart from the writers (``evidence``) and the checks (``chain_checks``) because
both compute them: an entry is hashed when it is appended and again when its chain is
verified, so the two must read the same fields in the same way.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from ..models import JournalEntry, LedgerEntry
from .hashing import canonical, hmac_hex, sha256_hex

GENESIS = "0" * 64


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


def _entry_hash(prev_hash: str, entry: Any, fields: Iterable[str], key: bytes | None) -> str:
    body = {name: getattr(entry, name) for name in fields}
    body["run_id"] = str(body["run_id"])
    text = prev_hash + canonical(body)
    return sha256_hex(text) if key is None else hmac_hex(key, text)


def journal_hash(prev_hash: str, entry: JournalEntry, key: bytes | None) -> str:
    return _entry_hash(prev_hash, entry, _JOURNAL_FIELDS, key)


def ledger_hash(prev_hash: str, entry: LedgerEntry, key: bytes | None) -> str:
    return _entry_hash(prev_hash, entry, _LEDGER_FIELDS, key)


def anchor(run_id: uuid.UUID, chain: str, count: int, head: str, key_id: str, key: bytes) -> str:
    """The run row's seal over one chain: which run, which chain, how many entries, which head."""
    mac = hmac_hex(key, canonical([str(run_id), chain, count, head]))
    return f"{key_id}:{mac}"
