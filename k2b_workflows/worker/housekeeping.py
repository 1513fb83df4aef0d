"""The main loop's periodic passes: housekeeping, and firing due schedule ticks.

Both run between claims on the main loop's connection, each in a transaction
of its own (never inside a claim), and each at most so often: what they find
is rarely due, and a pass per claim would cost a commit per run.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from django.db import transaction

from .. import settings
from ..kernel import ai, batches, claim, flow, schedule_passes, waits
from ..workflows import registered_versions
from . import timeouts

__all__ = ["Housekeeping", "SchedulePasses"]

logger = logging.getLogger(__name__)


class Housekeeping:
    """Re-queues expired leases, promotes due waits, cancels overdue runs, enqueues the
    callbacks of batches whose members have all finished."""

    def __init__(
        self,
        using: str,
        stats: Counter[str],
        worker_id: str = "",
        executing: Callable[[], Sequence[Any]] = tuple,
    ) -> None:
        self.using = using
        self.stats = stats
        #: This worker, and the runs it executes in time (its keeper's): the reap
        #: leaves those to the keeper, however late it renews them (#38).
        self.worker_id = worker_id
        self.executing = executing
        self._last = 0.0
        #: The database's time of the last admission of keyed runs that became due.
        self._keyed_due_since: dt.datetime | None = None

    @property
    def admitted_until(self) -> dt.datetime | None:
        """The ``now`` of the last pass that admitted due keyed runs (None: none yet)."""
        return self._keyed_due_since

    def run(self, poll: float) -> int:
        """One pass (at most every half poll); returns how many runs it made claimable."""
        now = time.monotonic()
        if now - self._last < min(poll, 0.5):
            return 0
        self._last = now
        with transaction.atomic(using=self.using):
            reaped = claim.reap_expired(self.using, self.worker_id, self.executing())
            promoted = claim.promote_due_waits(self.using)
            ai.reap_expired(self.using)
            waits.purge_stale_rendezvous(self.using)
            overdue = timeouts.overdue(self.using)
            if any(d.concurrency is not None for d in registered_versions()):
                # Keyed runs started with a run_after take a slot once due (#35).
                self._keyed_due_since, admitted = flow.admit_due(self.using, self._keyed_due_since)
                promoted += admitted
            finished = batches.due(self.using)
        if reaped:
            logger.warning("re-queued %d run(s) whose lease expired", reaped)
        if overdue:
            self.stats["timed_out"] += timeouts.cancel_overdue(self.using, overdue)
        # Each in a transaction of its own: a batch whose callbacks cannot start now
        # (its row refused) must not undo the passes above.
        fired = batches.fire_due(self.using, finished) if finished else 0
        self.stats["reaped"] += reaped
        self.stats["deadlines"] += promoted
        self.stats["batches"] += fired
        return reaped + promoted + fired


class SchedulePasses:
    """Fires the due ticks of the worker's workflows, probing at most once per interval."""

    def __init__(
        self,
        using: str,
        workflows: Callable[[], list[tuple[str, int]]],
        stats: Counter[str],
        *,
        enabled: bool,
    ) -> None:
        self.using = using
        self.workflows = workflows
        self.stats = stats
        #: Run schedule passes (``runworkflows --no-schedules``: False).
        self.enabled = enabled
        #: ``time.monotonic()`` of the next "is a tick due?" probe.
        self.next_check = 0.0

    def fire(self, *, force: bool = False) -> int:
        """Fire the due ticks of this worker's workflows; returns the runs started.

        Probes first (one indexed read), at most once per
        ``SCHEDULE_PASS_INTERVAL_MS`` unless ``force``; the next probe is
        brought forward to the next tick it learned of.
        """
        if not self.enabled:
            return 0
        now = time.monotonic()
        if not force and now < self.next_check:
            return 0
        interval = settings.schedule_pass_interval_ms() / 1000
        self.next_check = now + interval
        versions: dict[str, set[int]] = {}
        for name, version in self.workflows():
            versions.setdefault(name, set()).add(version)
        if not versions:
            return 0
        started = 0
        for _ in range(10):  # bounded: claims wait meanwhile; the next call goes on
            due_in, buffered = schedule_passes.probe(self.using, sorted(versions))
            if not buffered and (due_in is None or due_in > 0):
                break
            result = schedule_passes.run_pass(self.using, versions, buffered=buffered)
            started += result.started
            self.stats["scheduled"] += result.started
            if not result.rows:
                break
        if due_in is not None and due_in > 0:
            self.next_check = min(self.next_check, now + due_in)
        return started
