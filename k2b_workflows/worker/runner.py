"""What a pool thread does: execute claimed runs one after another, and AI tasks.

A pool thread that finishes a run starts the next claimed one itself, so no
thread waits for the main loop between runs. A database error here is never the
run's failure: the run is given back to the main loop to hand back, and when
connections are short (the claim got one, this thread none) claims pause.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections import Counter

from django.db import DatabaseError, connections

from .. import metrics, settings
from ..kernel import ai, weather
from ..kernel.execute import Execution
from ..kernel.leases import LeaseKeeper
from ..kernel.load import Preloaded
from ..kernel.together import EndsTogether
from .claims import Claims
from .connections import keep_or_close
from .prefetch import Prefetch

__all__ = ["Runner"]

logger = logging.getLogger(__name__)


class Runner:
    """Executes claimed runs and AI tasks on pool threads; pauses claims if connections run out."""

    def __init__(
        self,
        *,
        using: str,
        claims: Claims,
        keeper: LeaseKeeper,
        prefetch: Prefetch,
        stats: Counter[str],
        lock: threading.Lock,
        stopping: threading.Event,
        wake: threading.Event,
    ) -> None:
        self.using = using
        self.claims = claims
        self.keeper = keeper
        self.prefetch = prefetch
        self.stats = stats
        self.lock = lock
        self.stopping = stopping
        self.wake = wake
        #: No claims before this ``time.monotonic()``: connections are short.
        self.claims_paused_until = 0.0
        self._shortage = weather.Backoff(first=0.2, cap=5.0)

    def run_queued(self) -> None:
        """Execute queued runs one after another until the queue is empty or we stop.

        A run whose end writes nothing but pure work may commit it with the ends of
        the next claimed runs of the same workflow (or task), which then execute
        inside its end, here (``kernel/together.py``).
        """
        while not self.stopping.is_set():
            ready = self.claims.next_ready()
            if ready is None:
                return
            run_id, generation, loaded = ready
            self.wake.set()  # the loop may top the queue up
            kind = _kind(loaded)
            together = None
            if kind is not None and (max_ends := settings.pure_ends_together()) > 1:
                together = EndsTogether(
                    self.using, functools.partial(self._join, kind=kind), max_ends=max_ends
                )
            self.execute_run(run_id, generation, loaded, together=together)

    def _join(self, together: EndsTogether, kind: tuple[str, int, str]) -> bool:
        """Execute the next claimed run inside ``together``'s end, if it is a run of the
        same ``kind``; whether one ran."""
        if self.stopping.is_set():
            return False
        ready = self.claims.next_ready_if(lambda loaded: _kind(loaded) == kind)
        if ready is None:
            return False
        self.wake.set()
        # What the joined run took (its own joins included, theirs set aside): the
        # run whose end it joined does not count it as its own time.
        started, joined = time.monotonic(), together.joined_seconds
        self.execute_run(*ready, together=together)
        together.joined_seconds = joined + time.monotonic() - started
        return True

    def execute_run(
        self,
        run_id: uuid.UUID,
        generation: int,
        loaded: Preloaded | None,
        *,
        together: EndsTogether | None = None,
    ) -> None:
        started = time.monotonic()
        joined = together.joined_seconds if together is not None else 0.0
        try:
            if not self._connected(run_id, generation):
                return
            execution = Execution(
                run_id, generation, using=self.using, keeper=self.keeper, preloaded=loaded
            )
            execution.stop_requested = self.stopping
            if together is not None:
                together.run_started = started
                execution.together = together
            outcome = execution.execute()
            if execution.release_pending:
                self.claims.give_back(run_id, generation)
            with self.lock:
                self.stats["runs"] += 1
                # Its value: an Outcome key printed as <Outcome.SUCCEEDED: 'succeeded'>.
                self.stats[str(outcome)] += 1
                self.stats["steps"] += execution.steps_executed
        except Exception as exc:
            if weather.is_connection_error(exc):
                metrics.count_db_reconnect("run")
                logger.warning("run %s: database unavailable: %s", run_id, weather.describe(exc))
                weather.close_quietly(self.using)
                self.claims.give_back(run_id, generation)
            else:
                logger.exception("run %s: unexpected error in the worker", run_id)
                self.stats["errors"] += 1
        finally:
            self.keeper.untrack(run_id)  # a dropped execution never tracked it itself
            with self.lock:
                self.claims.claimed.pop(run_id, None)
                if together is not None:  # the runs that executed inside its end
                    started += together.joined_seconds - joined
                self.prefetch.ran(time.monotonic() - started)
            keep_or_close(self.using)

    def _connected(self, run_id: uuid.UUID, generation: int) -> bool:
        """Make sure this thread has a connection before the run's first step.

        With connections short (``max_connections``, a role's connection limit,
        a pooler's limit) the claim succeeded on the main loop's connection but
        this thread gets none: that is not the run's failure. The run goes back
        to the queue now and claims pause for a while.
        """
        if weather.hung_up(self.using):
            weather.close_quietly(self.using)
        try:
            connections[self.using].ensure_connection()
        except DatabaseError as exc:
            if not weather.is_connection_error(exc):
                raise
            weather.close_quietly(self.using)
            with self.lock:
                delay = self._shortage.next()
                self.claims_paused_until = time.monotonic() + delay
            logger.warning(
                "run %s: database unavailable: no connection for this run (%s);"
                " handing it back, claiming again in %.1f s",
                run_id,
                weather.describe(exc),
                delay,
            )
            self.claims.give_back(run_id, generation)
            return False
        with self.lock:
            self._shortage.reset()
        return True

    def execute_task(self, task: tuple) -> None:
        abort = threading.Event()
        task_id, generation = task[0], task[1]
        self.keeper.track_task(task_id, generation, abort)
        try:
            outcome = ai.run_task(self.using, task, abort)
            with self.lock:
                self.stats[f"ai_{outcome}"] += 1
        except Exception as exc:
            if weather.is_connection_error(exc):
                # The task's lease expires and it is queued again (the provider
                # result, if any, is lost with this claim: see kernel/ai.py).
                logger.warning(
                    "AI task %s: database unavailable: %s", task_id, weather.describe(exc)
                )
                weather.close_quietly(self.using)
            else:
                logger.exception("AI task %s: unexpected error in the worker", task_id)
        finally:
            self.keeper.untrack_task(task_id)
            keep_or_close(self.using)


def _kind(loaded: Preloaded | None) -> tuple[str, int, str] | None:
    """What a claimed run is a run of (workflow, version, task path), for ``_join``: runs
    of one kind take about as long as each other. None: not read at the claim."""
    if loaded is None:
        return None
    run = loaded.run
    return (run.workflow_name, run.workflow_version, run.task_path)
