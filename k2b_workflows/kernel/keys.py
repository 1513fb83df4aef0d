"""The evidence keys: derived from the settings, never stored, rotated like ``SECRET_KEY``.

Whoever can write the kernel's tables but holds no key cannot recompute a
chain, an anchor or a seal. The secrets come from ``EVIDENCE_KEYS`` (newest
first: the first signs, all verify) or else from ``SECRET_KEY`` and
``SECRET_KEY_FALLBACKS``; each key is derived from its secret the way
``django.core.signing`` derives its keys, and named by a short digest of the
key (its id), which the entries record instead of the key.

Derived here rather than in ``store.py``: the settings module reads settings,
the kernel decides what a key is.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.crypto import salted_hmac

from .. import settings as k2b_settings

_KEY_SALT = "k2b_workflows.evidence"


@functools.lru_cache(maxsize=32)
def _derive(secret: str | bytes) -> tuple[str, bytes]:
    """(key id, key) for one secret, derived the way ``django.core.signing`` derives its keys.

    The secret itself is never used as a key: another use of ``SECRET_KEY`` (sessions,
    password reset tokens) cannot produce an evidence hash, nor the other way round.
    """
    key = salted_hmac(_KEY_SALT, "evidence key", secret=secret, algorithm="sha256").digest()
    key_id = hmac.new(key, b"key id", hashlib.sha256).hexdigest()[:8]
    return key_id, key


_evidence_keys: tuple[tuple[str, bytes], ...] | None = None


@receiver(setting_changed)
def _forget_evidence_keys(*, setting: str, **kwargs: Any) -> None:
    global _evidence_keys
    if setting in ("K2B_WORKFLOWS", "SECRET_KEY", "SECRET_KEY_FALLBACKS"):
        _evidence_keys = None


def evidence_keys() -> tuple[tuple[str, bytes], ...]:
    """The evidence keys, newest first, as (key id, key): the first one signs.

    Read from the settings once (every step hashes several times), and again
    after a change of the settings they come from (``setting_changed``, as in tests).
    """
    global _evidence_keys
    if _evidence_keys is None:
        _evidence_keys = tuple(_read_evidence_keys())
    return _evidence_keys


def _read_evidence_keys() -> list[tuple[str, bytes]]:
    secrets = k2b_settings.evidence_key_secrets()
    if secrets is None:
        secrets = [settings.SECRET_KEY, *getattr(settings, "SECRET_KEY_FALLBACKS", [])]
    if isinstance(secrets, (str, bytes)) or not secrets or not all(secrets):
        raise ImproperlyConfigured(
            "K2B_WORKFLOWS['EVIDENCE_KEYS'] must be a non-empty list of non-empty secrets"
        )
    return [_derive(secret) for secret in secrets]
