"""Which retry policy a step runs under, and what it says: bound, delay, codes.

The failure this guards against: a policy honored on one path and not on
another (a retryable ``failed()``, an exception, a crash counted at the
claim), so that a step declared "at most once" is tried five times after a
crash. Every path of ``execute.py`` asks here.
"""

from __future__ import annotations

from .. import settings
from ..actions import Action
from ..retries import Retry, largest_action_bound
from ..workflows import WorkflowDefinition


def policy_for(action: Action, definition: WorkflowDefinition) -> Retry | None:
    """The action's policy, else the workflow's, else None (the settings)."""
    return type(action).retry or definition.retry


def max_attempts(policy: Retry | None) -> int:
    return policy.max_attempts if policy is not None else settings.max_consecutive_failures()


def delay_ms(policy: Retry | None, failures: int) -> int:
    return policy.delay_ms(failures) if policy is not None else settings.backoff_ms(failures)


def retries(policy: Retry | None, code: str | None) -> bool:
    """Whether a retryable failure with ``code`` is retried."""
    return policy is None or policy.retries(code)


def claim_bound(definition: WorkflowDefinition) -> int:
    """The claim's backstop, before the step is known: a run past it crashed so often
    that it stops. No lower than the bound any action's policy allows: the step's
    own bound is checked when the step is reached (``Execution._new_step``)."""
    return max(max_attempts(definition.retry), largest_action_bound())
