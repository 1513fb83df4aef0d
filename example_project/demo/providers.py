"""Simulated outside systems, so the demo runs with no network.

``PaymentGateway`` deduplicates by idempotency key and can look a charge up,
like a real card processor; in "timeout" mode it makes the charge and then
fails to answer, the classic ambiguous effect. ``LegacyBank`` has no lookup
at all: after a timeout nobody but a person can tell what happened.
"""

from __future__ import annotations

import hashlib
import threading
import time

from django.db import IntegrityError, transaction

from .models import Payment


class ProviderTimeout(Exception):
    """The provider did not answer in time: the effect may or may not have happened."""


class PaymentGateway:
    def charge(self, *, idempotency_key: str, amount_cents: int, timeout: bool = False) -> str:
        try:
            with transaction.atomic():
                payment = Payment.objects.create(
                    idempotency_key=idempotency_key, amount_cents=amount_cents
                )
        except IntegrityError:
            payment = Payment.objects.get(idempotency_key=idempotency_key)
        if timeout:
            raise ProviderTimeout("payment gateway did not answer within 10 s")
        return f"ch_{payment.pk}"

    def find(self, idempotency_key: str) -> str | None:
        payment = Payment.objects.filter(idempotency_key=idempotency_key).first()
        return f"ch_{payment.pk}" if payment else None


class LegacyBank:
    def transfer(self, *, reference: str, amount_cents: int) -> str:
        raise ProviderTimeout("bank connection reset after the request was sent")


def summarize(request: dict, abort: threading.Event) -> dict:
    """A local stand-in for a language model: deterministic, a little slow, abortable."""
    for _ in range(5):
        if abort.is_set():
            raise InterruptedError("aborted")
        time.sleep(0.05)
    text = request.get("text", "")
    words = text.split()
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return {
        "summary": " ".join(words[:12]) + ("…" if len(words) > 12 else ""),
        "words": len(words),
        "fingerprint": digest,
    }
