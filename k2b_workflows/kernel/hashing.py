"""Keyed hashes: what every evidence hash, seal and witness line is made of.

The failure this is built around: a hash an attacker can recompute. Every
hash of the evidence (chains, anchors, seals, the witness's lines, the hashes
of inputs, principals, previews and outputs) is an HMAC-SHA256 under a key
kept outside the database (``keys.evidence_keys()``), over one canonical
JSON text (``canonical``): without the key nobody rewrites evidence and
recomputes it, nor recovers a small input by brute force. The chains
(``evidence``), the run seals (``seals``) and the witness (``witness``) all
hash through here.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from typing import Any

from .. import validation
from ..validation import canonical_json
from .keys import evidence_keys


def sha256_hex(text: str) -> str:
    """Unkeyed: only for chains written before keyed hashes (``key_id == ""``)."""
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=8)
def _keyed(key: bytes) -> hmac.HMAC:
    """The HMAC state after the key: each hash copies it instead of keying anew."""
    return hmac.new(key, digestmod=hashlib.sha256)


def hmac_hex(key: bytes, text: str) -> str:
    """HMAC-SHA256 of ``text`` under ``key``, as hex: every evidence hash is one."""
    # Not ``hmac.digest()``: its one-shot C path releases the GIL around a tiny
    # hash, and in a worker whose other threads are busy, getting the GIL back
    # costs many times the hash (docs/performance.md has the figures). A copy of
    # the keyed state keeps the GIL and skips the keying. A run makes about
    # fifteen of these.
    h = _keyed(key).copy()
    h.update(text.encode())
    return h.hexdigest()


def signing_key() -> tuple[str, bytes]:
    """The (key id, key) new evidence is made with."""
    return evidence_keys()[0]


def hash_value(value: Any) -> str:
    """Keyed hash of a JSON value's canonical text (inputs, principals, previews, outputs)."""
    return hmac_hex(signing_key()[1], canonical_json(value))


def hash_text(text: str) -> str:
    """``hash_value`` of the value whose canonical text is ``text``."""
    return hmac_hex(signing_key()[1], text)


def hash_optional(value: str | None) -> str:
    return hmac_hex(signing_key()[1], value) if value else ""


def same_input(stored: str, value: Any, current: str) -> bool:
    """Whether a journaled input hash is of ``value``, under whichever key made it.

    ``current`` is the hash under today's key; an entry made before a rotation (or
    before keyed hashes) is compared under the old keys and unkeyed SHA-256. This is
    replay's determinism check, not a security boundary: the chain covers the hash.
    """
    if hmac.compare_digest(stored, current):
        return True
    text = canonical_json(value)
    candidates = [hmac_hex(key, text) for _, key in evidence_keys()[1:]]
    candidates.append(sha256_hex(text))
    return any(hmac.compare_digest(stored, c) for c in candidates)


def redacted_summary(value: Any) -> dict[str, Any]:
    """What a late result may show an operator: its shape, never its contents.

    A provider's raw output can hold card numbers or live tokens; the keyed
    ``output_hash`` beside this summary proves which output it was.
    """
    summary: dict[str, Any] = {
        "type": type(value).__name__ if value is not None else "null",
        "size": len(canonical_json(value).encode()),
    }
    if isinstance(value, dict):
        summary["keys"] = sorted(str(k) for k in value)[:50]
    elif isinstance(value, list):
        summary["items"] = len(value)
    return summary


def canonical(value: Any) -> str:
    """``canonical_json`` of what the kernel built or read back as JSON: the same text.

    ``canonical_json`` first walks the value to explain bad input; the values
    hashed here are checked already (outputs where they entered, entries read
    from ``jsonb``), and they are hashed several times a step. Anything JSON
    cannot hold still goes to ``canonical_json``, for its error.
    """
    try:
        return validation.CANONICAL_JSON.encode(value)
    except (TypeError, ValueError):
        return canonical_json(value)
