"""Workflow timeouts: a run not ended within its workflow's ``timeout`` is canceled.

The failure this guards against: a run that waits for ever (a wake that
never comes, a provider that stays "pending", retries spread over days) and
keeps its children, its AI tasks and its place in every list, with no one
told. ``@workflow(..., timeout=timedelta(...))`` stamps ``timeout_at`` on each
run at its start (children too, with their own workflow's timeout); each
worker's housekeeping sweeps the runs past it (an index walk over the few
with a timeout that are still queued, running or waiting) and cancels them
with code ``WORKFLOW_TIMEOUT``, exactly as ``cancel_workflow_run`` would:
the subtree and its AI tasks too, an action running now sees
``ctx.canceled``, and what it returns afterwards is appended to the ledger as
evidence, never applied. An EXTERNAL step already dispatched is never run
again; its dispatch stays open in the ledger for the operator to reconcile
from the evidence. A run in ``needs_attention`` is left to its operator: a
timeout does not make an effect's outcome known.

Counted from the start (``created_at``), on the kernel's clock: under
``controlled_clock()`` an hour's timeout passes with ``clock.advance(hours=1)``.
"""

from __future__ import annotations

import logging
import uuid

from .. import codes, settings
from ..kernel import db

logger = logging.getLogger(__name__)

_OVERDUE_SQL = """
SELECT id FROM k2b_run
 WHERE timeout_at <= k2b_now() AND timeout_at IS NOT NULL
   AND status IN ('queued', 'running', 'waiting')
 ORDER BY timeout_at
 LIMIT %s
"""


def overdue(using: str, *, batch: int = 100) -> list[uuid.UUID]:
    """Ids of up to ``batch`` runs past their timeout. One statement: the worker's
    housekeeping reads it inside its own transaction, so an idle worker pays no
    commit for it."""
    return [row[0] for row in db.fetchall(using, _OVERDUE_SQL, [batch])]


def cancel_overdue(using: str | None = None, run_ids: list[uuid.UUID] | None = None) -> int:
    """Cancel the runs past their timeout (``run_ids`` as ``overdue`` found them);
    each is checked again under its lock. Returns how many were canceled."""
    from ..control import cancel_run

    using = using or settings.database()
    canceled = 0
    for run_id in overdue(using) if run_ids is None else run_ids:
        run = cancel_run(
            run_id,
            "the workflow's timeout passed before the run ended",
            code=codes.WORKFLOW_TIMEOUT,
            overdue=True,
        )
        if run.status == "canceled" and run.error_code == codes.WORKFLOW_TIMEOUT:
            canceled += 1
            logger.warning("run %s: timed out (%s); canceled", run_id, run.display_name)
    return canceled
