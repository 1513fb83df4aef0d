"""Signals sent once a run's change of state has committed: hooks for alerting and metrics.

Receivers run in the worker's thread after the commit (never for a change
that rolled back), with ``sender=WorkflowRun``. A receiver that raises is
logged and does not disturb the worker.

``run_needs_attention``: ``run_id``, ``workflow_name``, ``error_code``, ``message``, ``step``
    an operator must decide (page someone here).
``run_finished``: ``run_id``, ``workflow_name``, ``status``, ``error_code``
    a run ended: succeeded, failed or canceled.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.dispatch import Signal

from .models import WorkflowRun

logger = logging.getLogger(__name__)

run_needs_attention = Signal()
"""Sent when a run stops for an operator: ``run_id``, ``workflow_name``, ``error_code``,
``message``, ``step``. Page someone from a receiver."""

run_finished = Signal()
"""Sent when a run ends: ``run_id``, ``workflow_name``, ``status`` (succeeded, failed or
canceled), ``error_code``."""


def send_on_commit(signal: Signal, using: str, **kwargs: Any) -> None:
    """Send ``signal`` when the current transaction commits (at once outside one)."""

    def send() -> None:
        for receiver, result in signal.send_robust(sender=WorkflowRun, **kwargs):
            if isinstance(result, Exception):
                logger.error("receiver %r of a k2b_workflows signal raised %r", receiver, result)

    transaction.on_commit(send, using=using)
