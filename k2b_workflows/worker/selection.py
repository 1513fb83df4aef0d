"""Which runs this worker takes: its apps, its queues, and the versions registered for them.

A worker started with ``--app`` or ``--queue`` must claim, count as pending and
schedule only what it can run; one object answers "which workflows?" for the
claim, the burst check and the schedule pass, so they cannot disagree.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from typing import Any

from django.db import connections

from ..kernel import ai, flow
from ..workflows import registered_versions

__all__ = ["Selection"]

#: The start lines go to the package's logger by name (docs/operations.md).
lifecycle = logging.getLogger("k2b_workflows")

#: For ``burst``: is a run of ours queued (even delayed) or claimable soon? The
#: ``{filters}`` are the app and queue conditions, when the worker has them. A
#: paused queue's runs are not pending: a burst worker stops with them queued (#49).
_PENDING_RUNS_SQL = """SELECT EXISTS (SELECT 1 FROM k2b_run
     WHERE (workflow_name, workflow_version)
           IN (SELECT * FROM unnest(%s::text[], %s::int[])) {filters}
        AND (((status = 'queued' AND {claimable}) OR {unadmitted_keyed}) AND {not_paused}
             OR (status = 'running'
                 AND lease_expires_at < k2b_now())))"""
_APP_FILTER = "AND app_id = ANY(%s)"
_QUEUE_FILTER = " AND queue = ANY(%s)"
#: For ``burst``: is an AI task of a provider this process has queued?
_PENDING_AI_TASKS_SQL = (
    "SELECT EXISTS (SELECT 1 FROM k2b_ai_task WHERE status = 'queued' AND provider = ANY(%s))"
)


class Selection:
    """The apps (``--app``) and django.tasks queues (``--queue``) a worker takes runs of."""

    def __init__(self, app_ids: Sequence[str] | None, queues: Sequence[str] | None) -> None:
        self.app_ids = list(app_ids) if app_ids else None
        #: ``--queue``: only task runs of these django.tasks queues (None: every run).
        self.queues = list(dict.fromkeys(queues)) if queues else None

    def workflows(self) -> list[tuple[str, int]]:
        """The (name, version) pairs this worker runs: every registered version of its apps."""
        return [
            (d.name, d.version)
            for d in registered_versions()
            if not self.app_ids or d.app_id in self.app_ids
        ]

    def pending(self, using: str, admitted_until: dt.datetime | None = None) -> bool:
        """For ``burst``: is anything of ours queued (even delayed) or claimable soon?

        ``admitted_until``: the ``now`` of the housekeeping's last ``admit_due``.
        A keyed run that became due after it has no slot yet, and is pending
        work all the same: the next pass admits it. Read against the clock
        alone, a run due between that pass and this check was neither
        claimable nor delayed, and a burst worker (``run_until_idle``) stopped
        with it queued.
        """
        workflows = self.workflows()
        params: list[Any] = [[n for n, _ in workflows], [v for _, v in workflows]]
        filters = ""
        if self.app_ids:
            filters = _APP_FILTER
            params.append(self.app_ids)
        if self.queues:
            filters += _QUEUE_FILTER
            params.append(self.queues)
        params.append(admitted_until)
        sql = _PENDING_RUNS_SQL.format(
            filters=filters,
            claimable=flow.CLAIMABLE,
            unadmitted_keyed=flow.UNADMITTED_KEYED,
            not_paused=flow.NOT_PAUSED,
        )
        with connections[using].cursor() as cursor:
            cursor.execute(sql, params)
            if cursor.fetchone()[0]:
                return True
            providers = list(ai.providers())
            if not providers:
                return False
            cursor.execute(_PENDING_AI_TASKS_SQL, [providers])
            return bool(cursor.fetchone()[0])

    def say_unknown_apps(self, worker_id: str) -> None:
        """Warn of each ``--app`` that no registered workflow has, naming those that exist.

        ``runworkflows --app shpo`` (a typo) idled for ever without a word. A
        warning, not a refusal: such a worker still claims that app's AI tasks
        (a process may carry only the providers), and a fleet's command line can
        name an app before the code that defines it reaches every process (a
        rolling deploy); refusing would make those processes exit in a loop.
        """
        if not self.app_ids:
            return
        known = sorted({d.app_id for d in registered_versions()})
        for app_id in self.app_ids:
            if app_id not in known:
                lifecycle.warning(
                    "worker %s: no registered workflow has app id %r (known: %s); this worker"
                    " runs no workflow of it, only its AI tasks: a typo?",
                    worker_id,
                    app_id,
                    ", ".join(known) or "none",
                )
