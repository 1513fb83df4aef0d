"""``Concurrency`` and ``RateLimit``: what a workflow or an action declares about flow control.

Plain, validated values. A malformed declaration is refused where it is
written (``InvalidInput`` naming the field), not when the first run meets it
in a worker: a limit of 0 would queue every run of a key for ever, and a
``per`` of a negative duration would admit every dispatch. The kernel's side
(slots, admission, deferrals) is ``kernel/flow.py``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from . import validation
from .exceptions import InvalidInput

#: Most runs of one key that may be active at once, and most dispatches a rate
#: limit admits per window: PostgreSQL ``integer``.
MAX_LIMIT = validation.MAX_INT
#: The longest rate-limit window: a year. Its dispatches are kept that long.
MAX_PER = timedelta(days=366)


class Strategy(enum.StrEnum):
    """What a start does when its key already has ``limit`` active runs."""

    #: The new run stays queued until a slot frees; first started, first admitted.
    QUEUE = "queue"
    #: The new run cancels the oldest active runs of the key to make room (latest wins).
    CANCEL_IN_PROGRESS = "cancel_in_progress"
    #: The new run is created canceled, code ``CONCURRENCY_LIMITED``.
    CANCEL_NEWEST = "cancel_newest"


@dataclass(frozen=True)
class Concurrency:
    """At most ``limit`` active runs of the workflow per ``concurrency_key``.

    Active: admitted to a slot and not yet succeeded, failed or canceled
    (running, waiting, queued for a retry or a takeover, needs_attention).
    """

    limit: int = 1
    strategy: Strategy | str = Strategy.QUEUE

    def __post_init__(self) -> None:
        validation.integer(self.limit, "Concurrency(limit=...)", minimum=1, maximum=MAX_LIMIT)
        try:
            strategy = Strategy(self.strategy)
        except ValueError:
            known = ", ".join(repr(s.value) for s in Strategy)
            raise InvalidInput(
                f"Concurrency(strategy=...) must be one of {known}, not {self.strategy!r}"
            ) from None
        object.__setattr__(self, "strategy", strategy)


@dataclass(frozen=True)
class RateLimit:
    """At most ``limit`` dispatches of an action (per ``rate_limit_key``) in any window ``per``."""

    limit: int
    per: timedelta = timedelta(seconds=1)

    def __post_init__(self) -> None:
        validation.integer(self.limit, "RateLimit(limit=...)", minimum=1, maximum=MAX_LIMIT)
        if not isinstance(self.per, timedelta):
            raise InvalidInput(
                f"RateLimit(per=...) must be a timedelta, not {type(self.per).__name__}"
            )
        if self.per < timedelta(milliseconds=1):
            raise InvalidInput(f"RateLimit(per=...) must be at least 1 ms, not {self.per}")
        if self.per > MAX_PER:
            # Accepted, a huge window failed every dispatch in PostgreSQL's date
            # arithmetic until the step's retries ran out (#35).
            raise InvalidInput(
                f"RateLimit(per=...) must be at most {MAX_PER.days} days, not {self.per}"
            )

    @property
    def per_ms(self) -> int:
        return int(self.per / timedelta(milliseconds=1))


def check_concurrency(value: Any) -> Concurrency | None:
    """``@workflow(concurrency=...)``: None or a ``Concurrency``."""
    if value is not None and not isinstance(value, Concurrency):
        raise InvalidInput(
            f"workflow(concurrency=...) must be a Concurrency, not {type(value).__name__}"
        )
    return value


def check_rate_limit(owner: str, value: Any) -> RateLimit | None:
    """``Action.rate_limit``: None or a ``RateLimit``."""
    if value is not None and not isinstance(value, RateLimit):
        raise InvalidInput(f"{owner}.rate_limit must be a RateLimit, not {type(value).__name__}")
    return value
