"""The runs this process has claimed and not finished, and handing them back.

A claimed run belongs to this process until it ends, its lease expires, or it
is handed back. Waiting out a lease delays a run for nothing when this process
knows it will not execute it (it is stopping, it lost its connection, a pool
thread found no connection): so every claimed run is tracked here, from the
claim through the local queue and the pool thread to its end, and whatever is
left is handed back (queued, no failure counted) instead of expiring.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import Counter, deque
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from django.db import DatabaseError, transaction

from .. import settings
from ..kernel import ai, claim, db, weather
from ..kernel.leases import LeaseKeeper
from ..kernel.load import Preloaded, preload, preload_statement, preloaded
from .selection import Selection

__all__ = ["Claims"]

logger = logging.getLogger(__name__)


class Claims:
    """Claimed runs, queued locally or executing, and the pool futures executing them.

    Every attribute is read and written under ``lock``, which the worker's
    other parts share (its counters are written under it too).
    """

    def __init__(
        self,
        *,
        using: str,
        worker_id: str,
        selection: Selection,
        keeper: LeaseKeeper,
        stats: Counter[str],
        lock: threading.Lock,
        wake: threading.Event,
    ) -> None:
        self.using = using
        self.worker_id = worker_id
        self.selection = selection
        self.keeper = keeper
        self.stats = stats
        self.lock = lock
        self.wake = wake
        #: Claimed (and preloaded) runs no thread has started yet: at most
        #: ``prefetch.current`` beyond the free threads. Their leases are renewed
        #: by the keeper; on stop they are handed back at once.
        self.ready: deque[tuple[uuid.UUID, int, Preloaded | None]] = deque()
        #: Runs claimed by this process and not yet finished, whether waiting in
        #: ``ready`` or executing: run id -> generation.
        self.claimed: dict[uuid.UUID, int] = {}
        #: Claimed runs a pool thread could not execute or release (no connection):
        #: the main loop hands them back with its own connection.
        self.to_hand_back: dict[uuid.UUID, int] = {}
        #: The pool's futures: runs and AI tasks executing now.
        self.inflight: set[Future] = set()

    # -- claiming ----------------------------------------------------------------

    def claim(
        self, limit: int, *, task_slots: int | None = None
    ) -> tuple[list[tuple[uuid.UUID, int]], dict[uuid.UUID, Preloaded], list]:
        """Claim runs, read their state, and claim AI tasks for the slots left: one commit.

        ``task_slots``: how many AI tasks may be claimed at most (default: ``limit``),
        less the runs claimed.
        """
        app_ids, queues = self.selection.app_ids, self.selection.queues
        statement = claim.claim_statement(
            self.worker_id, self.selection.workflows(), app_ids, limit, queues
        )
        task_slots = limit if task_slots is None else task_slots
        if statement is not None and db.batches_statements(self.using):
            # The same transaction in two round trips instead of four: "BEGIN; claim",
            # then "preload; COMMIT", the ids read in between.
            runs = db.begin_and_fetch(self.using, *statement, setting=claim.CLAIM_PLAN)
            try:
                slots = task_slots - len(runs)
                tasks = ai.claim_tasks(self.using, app_ids=app_ids, limit=slots)
            except BaseException:
                db.rollback_quietly(self.using)
                raise
            if runs:
                ids = [run_id for run_id, _ in runs]
                rows = db.fetch_and_commit(self.using, *preload_statement(ids))
                return runs, preloaded(self.using, rows), tasks
            if tasks:
                db.commit_open(self.using)
            else:
                db.rollback_quietly(self.using)  # it claimed nothing: nothing to commit
            return runs, {}, tasks
        with transaction.atomic(using=self.using):
            runs = claim.claim_runs(
                self.using,
                worker_id=self.worker_id,
                workflows=self.selection.workflows(),
                app_ids=app_ids,
                limit=limit,
                queues=queues,
            )
            loaded = preload(self.using, [run_id for run_id, _ in runs])
            tasks = []
            slots = task_slots - len(runs)
            if slots > 0:
                tasks = ai.claim_tasks(self.using, app_ids=app_ids, limit=slots)
        return runs, loaded, tasks

    def queue(self, runs: list[tuple[uuid.UUID, int]], loaded: dict[uuid.UUID, Preloaded]) -> None:
        """Hold freshly claimed runs for the pool threads, their leases renewed from now."""
        with self.lock:
            for run_id, generation in runs:
                self.claimed[run_id] = generation
                self.keeper.track(run_id, generation, threading.Event())
                self.ready.append((run_id, generation, loaded.get(run_id)))

    def next_ready(self) -> tuple[uuid.UUID, int, Preloaded | None] | None:
        """The next claimed run no thread has started, or None."""
        with self.lock:
            return self.ready.popleft() if self.ready else None

    def next_ready_if(
        self, wanted: Callable[[Preloaded | None], bool]
    ) -> tuple[uuid.UUID, int, Preloaded | None] | None:
        """The next claimed run no thread has started, if ``wanted`` takes its preload;
        else None, and the run stays first in line."""
        with self.lock:
            if self.ready and wanted(self.ready[0][2]):
                return self.ready.popleft()
            return None

    # -- the pool ----------------------------------------------------------------

    def submit(self, pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> None:
        future = pool.submit(fn, *args)
        with self.lock:
            self.inflight.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: Future) -> None:
        with self.lock:
            self.inflight.discard(future)
        self.wake.set()

    def in_flight(self) -> int:
        """Runs and AI tasks this process is executing now."""
        with self.lock:
            return len(self.inflight)

    def idle(self) -> bool:
        """Nothing executing, nothing claimed ahead, nothing left to hand back."""
        with self.lock:
            return not self.inflight and not self.to_hand_back and not self.ready

    def drain(self) -> None:
        """Wait for every pool future (their errors raise here)."""
        while True:
            with self.lock:
                pending = list(self.inflight)
            if not pending:
                return
            for future in pending:
                future.result()

    # -- handing back ------------------------------------------------------------

    def give_back(self, run_id: uuid.UUID, generation: int) -> None:
        """A pool thread cannot execute or release the run: the main loop hands it back."""
        with self.lock:
            self.to_hand_back[run_id] = generation
            self.stats["handed_back"] += 1
        self.wake.set()

    def release_ready(self) -> None:
        """Hand claimed runs that no thread started back to the queue (stopping)."""
        with self.lock:
            held = [(run_id, generation) for run_id, generation, _ in self.ready]
            self.ready.clear()
            for run_id, _ in held:
                self.claimed.pop(run_id, None)
        if not held:
            return
        for run_id, _ in held:
            self.keeper.untrack(run_id)
        try:
            with self.keeper.paused(), transaction.atomic(using=self.using):
                # No thread started them: nothing of ours can still commit for them.
                released = len(claim.hand_back(self.using, {r: (g, 0) for r, g in held}))
        except DatabaseError as exc:
            weather.close_quietly(self.using)
            logger.warning(
                "could not hand back %d prefetched run(s) (%s); their leases will expire",
                len(held),
                weather.describe(exc),
            )
            return
        self.stats["released"] += released

    def hand_back_claimed(self, keep: Collection[uuid.UUID] = ()) -> None:
        """Hand back every run still claimed when the shutdown grace ran out, but ``keep``.

        ``keep``: runs whose external call the worker goes on waiting for (only a
        second signal cuts a call). A run whose EXTERNAL ``run()`` is in flight
        becomes claimable one lease ahead; a run whose row a step transaction of
        ours locks is left to its lease (``claim.hand_back`` skips it). A run
        handed back is no longer ours: it leaves ``claimed``, and a later hand-back
        does not count it again.
        """
        lease = settings.lease_ms()
        external = self.keeper.external_in_flight()
        with self.lock:
            held = {
                run_id: (generation, lease if run_id in external else 0)
                for run_id, generation in {**self.claimed, **self.to_hand_back}.items()
                if run_id not in keep
            }
        if not held:
            return
        try:
            with self.keeper.paused(), transaction.atomic(using=self.using):
                handed = claim.hand_back(self.using, held)
        except DatabaseError as exc:
            weather.close_quietly(self.using)
            logger.warning(
                "worker %s: could not hand back %d run(s) (%s); their leases will expire",
                self.worker_id,
                len(held),
                weather.describe(exc),
            )
            return
        with self.lock:
            for run_id in handed:
                self.to_hand_back.pop(run_id, None)
                if self.claimed.get(run_id) == held[run_id][0]:
                    del self.claimed[run_id]
        self.stats["handed_back"] += len(handed)
        logger.info(
            "worker %s: handed back %d run(s) (%d after one lease: external effect in flight;"
            " %d locked by a step, left to their lease)",
            self.worker_id,
            len(handed),
            len(external & handed),
            len(held) - len(handed),
        )

    def hand_back_pending(self) -> None:
        """Release claimed runs that a pool thread could not execute for want of a connection.

        Not a failure of the run: no failure is counted, and the run is queued
        at once rather than left to expire as if this worker had crashed.
        """
        with self.lock:
            pending = dict(self.to_hand_back)
        if not pending:
            return
        with self.keeper.paused(), transaction.atomic(using=self.using):
            handed = claim.hand_back(self.using, {r: (g, 0) for r, g in pending.items()})
        with self.lock:
            for run_id in pending:
                self.to_hand_back.pop(run_id, None)
        if handed:
            logger.warning("database unavailable for %d claimed run(s); handed back", len(handed))

    def hand_back_orphans(self) -> None:
        """Hand back runs claimed for this worker by a commit whose answer was lost.

        Only runs claimed by this worker id that it is not executing: those it
        executes are in ``claimed``.
        """
        with self.lock:
            executing = list(self.claimed)
        with transaction.atomic(using=self.using):
            orphans = claim.hand_back_orphans(self.using, self.worker_id, executing)
        if orphans:
            logger.warning(
                "handed back %d run(s) claimed while the database connection was lost", orphans
            )
