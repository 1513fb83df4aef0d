"""Retry policies for one action or one workflow: ``Retry``.

The failure this guards against: one global bound (``RETRY_BACKOFF_MS``,
``RUN_MAX_CONSECUTIVE_FAILURES``) for every step, so a flaky provider that
needs ten patient tries and a card charge that must give up after one share
the same numbers. A policy on the action (``retry = Retry(...)``) wins for
its steps, else the workflow's (``@workflow(..., retry=Retry(...))``), else
the settings.

What a policy changes, and what stays: it sets how many attempts a step gets
in a row (the run's ``consecutive_failures``, reset by every completed step)
and the delays between them; past the bound the run fails with
``WORKFLOW_RETRY_EXHAUSTED``, or needs attention when an effect is
unresolved, exactly as with the settings. A crash (a lease that ran out
with no result) is counted against the same bound, but its delay is the
global one: the claim that notices it does not know the step. A retryable
``failed(..., code=...)`` whose code is in ``non_retryable_codes`` fails the
step instead (``StepFailed`` in the workflow). Delays are written to the
run's ``run_after`` on the kernel's clock, so ``controlled_clock()`` skips
them like any other backoff.
"""

from __future__ import annotations

import datetime as dt
import inspect
import random
from dataclasses import dataclass
from typing import Any

from .exceptions import InvalidInput

#: The largest ``max_attempts`` of any action's policy in this process: the claim's
#: backstop (a run that crashed that often) must not cut a patient action short.
_largest_action_bound = 0


@dataclass(frozen=True)
class Retry:
    """How often and how patiently a step is tried.

    - ``max_attempts``: attempts of one step in a row, the first included
      (1: never retried). Past it: ``WORKFLOW_RETRY_EXHAUSTED``.
    - ``backoff``: delay before the first retry (a ``timedelta`` or seconds).
    - ``max_backoff``: cap of the delay (None: ``RETRY_BACKOFF_MAX_MS``, or
      ``backoff`` if that is longer); each retry waits ``multiplier`` times
      longer than the one before.
    - ``jitter``: wait a random 50-100 % of the delay, so that runs failing
      together do not retry together.
    - ``non_retryable_codes``: codes of ``failed(..., retryable=True)`` that are
      not retried after all: the step fails with that code.
    - ``on``: the exception classes a raised exception is retried for (a class,
      or a tuple of classes or of their dotted paths); any other exception
      fails the step (a task: the call ends FAILED) at once. Empty: every
      exception, as before. Kept as dotted paths, matched against the raised
      exception's classes by name: a worker need not import them to judge.
    """

    max_attempts: int
    backoff: dt.timedelta | float = dt.timedelta(seconds=1)
    max_backoff: dt.timedelta | float | None = None
    jitter: bool = True
    non_retryable_codes: tuple[str, ...] | list[str] | frozenset[str] = ()
    multiplier: float = 2.0
    on: Any = ()

    def __post_init__(self) -> None:
        attempts = self.max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise InvalidInput(f"Retry.max_attempts must be an integer >= 1, not {attempts!r}")
        if attempts > 1_000_000:
            raise InvalidInput(f"Retry.max_attempts must be at most 1000000, not {attempts}")
        backoff = _seconds(self.backoff, "Retry.backoff")
        cap = None if self.max_backoff is None else _seconds(self.max_backoff, "Retry.max_backoff")
        if cap is not None and cap < backoff:
            raise InvalidInput(
                f"Retry.max_backoff ({cap} s) must not be shorter than Retry.backoff ({backoff} s)"
            )
        multiplier = self.multiplier
        if isinstance(multiplier, bool) or not isinstance(multiplier, int | float):
            raise InvalidInput(f"Retry.multiplier must be a number >= 1, not {multiplier!r}")
        if not 1 <= multiplier <= 100:
            raise InvalidInput(f"Retry.multiplier must be between 1 and 100, not {multiplier!r}")
        if not isinstance(self.jitter, bool):
            raise InvalidInput(f"Retry.jitter must be True or False, not {self.jitter!r}")
        codes = self.non_retryable_codes
        if isinstance(codes, str) or not isinstance(codes, tuple | list | frozenset | set):
            raise InvalidInput(
                f"Retry.non_retryable_codes must be a tuple of error codes, not {codes!r}"
            )
        for code in codes:
            if not isinstance(code, str) or not code or len(code) > 100:
                raise InvalidInput(
                    f"Retry.non_retryable_codes holds {code!r}: codes are non-empty strings"
                )
        object.__setattr__(self, "backoff", dt.timedelta(seconds=backoff))
        if cap is not None:
            object.__setattr__(self, "max_backoff", dt.timedelta(seconds=cap))
        object.__setattr__(self, "non_retryable_codes", tuple(codes))
        object.__setattr__(self, "on", _exception_paths(self.on))

    def delay_ms(self, failures: int) -> int:
        """Delay before retry number ``failures`` (1-based)."""
        if failures <= 0:
            return 0
        from . import settings

        first = _as_timedelta(self.backoff).total_seconds() * 1000
        if self.max_backoff is None:
            cap = max(first, settings.retry_backoff_max_ms())
        else:
            cap = _as_timedelta(self.max_backoff).total_seconds() * 1000
        delay = min(first * self.multiplier ** min(failures - 1, 64), cap)
        if self.jitter:
            delay *= random.uniform(0.5, 1.0)
        return int(delay)

    def retries(self, code: str | None) -> bool:
        """Whether a retryable failure with ``code`` is retried under this policy."""
        return code is None or code not in self.non_retryable_codes

    def retries_exception(self, exc: BaseException) -> bool:
        """Whether a raised ``exc`` is retried under this policy (``on``): its class or
        one of its bases is named there, or ``on`` names none."""
        return not self.on or any(class_path(c) in self.on for c in type(exc).__mro__)


def class_path(cls: type) -> str:
    """``module.QualifiedName``: how ``Retry.on`` names a class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _exception_paths(value: Any) -> tuple[str, ...]:
    """``Retry.on`` as the dotted paths of exception classes.

    A path is imported once, here, to refuse a typo that would otherwise never
    match and so silently retry nothing. Builtins may be named bare
    (``"ConnectionError"``).
    """
    items = (value,) if isinstance(value, str | type) else value
    if not isinstance(items, tuple | list | frozenset | set):
        raise InvalidInput(
            f"Retry.on must be an exception class or a tuple of them, not {value!r:.80}"
        )
    paths = []
    for item in items:
        if isinstance(item, str):
            item = _import_exception(item)
        if not (isinstance(item, type) and issubclass(item, BaseException)):
            raise InvalidInput(f"Retry.on holds {item!r:.80}: exception classes only")
        paths.append(class_path(item))
    return tuple(dict.fromkeys(paths))


def _import_exception(path: str) -> Any:
    from django.utils.module_loading import import_string

    dotted = path if "." in path else f"builtins.{path}"
    try:
        return import_string(dotted)
    except ImportError as exc:
        raise InvalidInput(f"Retry.on names {path!r}, which does not import: {exc}") from None


def _as_timedelta(value: dt.timedelta | float) -> dt.timedelta:
    return value if isinstance(value, dt.timedelta) else dt.timedelta(seconds=value)


def _seconds(value: Any, field: str) -> float:
    if isinstance(value, dt.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise InvalidInput(f"{field} must be a timedelta or a number of seconds, not {value!r}")
    if not 0 <= seconds <= 366 * 86_400:
        raise InvalidInput(f"{field} must be between 0 and a year, not {seconds} s")
    return seconds


def check_policy(value: Any, field: str) -> Retry | None:
    """``value`` if it is a ``Retry`` (or None); else a clear error naming ``field``."""
    if value is None or isinstance(value, Retry):
        return value
    if inspect.isclass(value) and issubclass(value, Retry):
        raise InvalidInput(f"{field} must be a Retry(...) instance, not the class")
    raise InvalidInput(f"{field} must be a Retry(...), not {value!r:.80}")


def action_declared(policy: Retry) -> None:
    """Note an action's policy: the claim's backstop allows its bound."""
    global _largest_action_bound
    _largest_action_bound = max(_largest_action_bound, policy.max_attempts)


def largest_action_bound() -> int:
    return _largest_action_bound
