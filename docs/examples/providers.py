"""Stand-ins for the outside world the examples talk to: a card gateway, a mailer,
a courier, an SMS service, an invoicing provider, a bank, a pager and an AI client.

Each remembers what it was asked in memory, as the real service would on its
side, so that a test can count effects across crashes and retries. Providers
that deduplicate do it by the caller's idempotency key, as real ones do.
``reset()`` forgets everything (the tests call it before each example).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Charge:
    id: str
    amount: int
    idempotency_key: str


class Fake:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        raise NotImplementedError


class Gateway(Fake):
    """A card gateway that deduplicates charges by idempotency key."""

    def reset(self) -> None:
        self.charges: dict[str, Charge] = {}
        self.calls: list[str] = []
        self._ids = itertools.count(1)

    def charge(self, amount: int, *, idempotency_key: str) -> Charge:
        self.calls.append(idempotency_key)
        if idempotency_key not in self.charges:
            self.charges[idempotency_key] = Charge(f"ch_{next(self._ids)}", amount, idempotency_key)
        return self.charges[idempotency_key]

    def find(self, *, idempotency_key: str) -> Charge | None:
        return self.charges.get(idempotency_key)


class Mailer(Fake):
    """A mail provider that sends one message per idempotency key."""

    def reset(self) -> None:
        self.sent: dict[str, dict[str, str]] = {}
        self.calls: list[str] = []

    def send(self, *, to: str, template: str, idempotency_key: str) -> None:
        self.calls.append(idempotency_key)
        self.sent.setdefault(idempotency_key, {"to": to, "template": template})


class Courier(Fake):
    """Books one pickup per idempotency key."""

    def reset(self) -> None:
        self.bookings: dict[str, str] = {}

    def book(self, item: str, *, idempotency_key: str) -> str:
        self.bookings.setdefault(idempotency_key, item)
        return f"pickup-{len(self.bookings)}"


class Sms(Fake):
    """An SMS service without deduplication: every call sends a message."""

    def reset(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def send(self, to: str, text: str) -> None:
        self.sent.append((to, text))


@dataclass
class InvoiceResult:
    number: str


class InvoiceProvider(Fake):
    """Creates one invoice per idempotency key; ``during_call`` runs inside each call."""

    def reset(self) -> None:
        self.invoices: dict[str, InvoiceResult] = {}
        self.calls: list[str] = []
        self.during_call: Callable[[], None] | None = None

    def create_invoice(self, *, order: int, idempotency_key: str) -> InvoiceResult:
        self.calls.append(idempotency_key)
        if idempotency_key not in self.invoices:
            self.invoices[idempotency_key] = InvoiceResult(f"INV-{order}-{len(self.invoices) + 1}")
        if self.during_call is not None:
            self.during_call()
        return self.invoices[idempotency_key]


class Bank(Fake):
    """Accepts payouts and settles them later; ``settle()`` plays the bank's side."""

    def reset(self) -> None:
        self.payouts: dict[str, dict[str, Any]] = {}
        self.status_queries = 0

    def submit_payout(self, *, reference: str, amount: int) -> None:
        self.payouts.setdefault(reference, {"amount": amount, "state": "pending"})

    def payout_status(self, *, reference: str) -> str:
        self.status_queries += 1
        return self.payouts[reference]["state"] if reference in self.payouts else "unknown"

    def settle(self, reference: str, state: str = "settled") -> None:
        self.payouts[reference]["state"] = state


class Pager(Fake):
    def reset(self) -> None:
        self.pages: list[tuple[str, str]] = []

    def trigger(self, message: str, *, link: str) -> None:
        self.pages.append((message, link))


class ChatClient(Fake):
    """An AI client: answers with a fixed summary and counts the calls."""

    def reset(self) -> None:
        self.calls: list[list[dict[str, str]]] = []

    def chat(self, messages: list[dict[str, str]], *, timeout: float) -> dict[str, str]:
        self.calls.append(messages)
        return {"summary": f"summary of {len(messages)} message(s)"}


gateway = Gateway()
mailer = Mailer()
courier = Courier()
sms = Sms()
provider = InvoiceProvider()
bank = Bank()
pager = Pager()
client = ChatClient()


def reset() -> None:
    """Forget every call: each example starts with providers that have seen nothing."""
    for fake in (gateway, mailer, courier, sms, provider, bank, pager, client):
        fake.reset()
