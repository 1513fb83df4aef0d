"""``ctx``: what every action hook receives, and the fence it can take.

``KernelStepContext`` is the kernel's implementation of the ``StepContext``
protocol that ``actions.py`` declares: actions are written against the
protocol, so the definitions never import the kernel.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from django.db import connections, transaction

from .. import settings
from ..exceptions import InvalidInput, LeaseLost, RunCanceled
from . import ai, clock, db

# Where the run lock is tracked; importable from here for the kernel's older callers.
from .db import holding_run_lock
from .db import holds_run_lock as holds_run_lock

if TYPE_CHECKING:
    from ..actions import Result
    from ..actions import StepContext as StepContextProtocol
    from ..models import WorkflowRun


class ExecutionState(Protocol):
    """What a step context reads from the execution that makes it (a real one or a dry run)."""

    run_id: Any
    root_id: Any
    app_id: str
    generation: int
    principal: Any
    canceled: threading.Event
    using: str
    run: WorkflowRun


_HEARTBEAT_SQL = (
    "UPDATE k2b_run"
    " SET lease_expires_at = k2b_now() + %s * interval '1 millisecond'"
    " WHERE id = %s AND generation = %s AND status = 'running' RETURNING id"
)

_STATUS_SQL = "SELECT status FROM k2b_run WHERE id = %s"

#: Whether the call was asked to stop (``tasks.cancel``), and whether the run is still ours.
_ASKED_SQL = (
    "SELECT cancel_requested_at IS NOT NULL, status = 'running' AND generation = %s"
    " FROM k2b_run WHERE id = %s"
)


class KernelStepContext:
    """Identity of a run and step, and the kernel services an action may use.

    ``now()`` is the kernel's clock, the one its deadlines, backoff and leases
    are measured on (``k2b_now()`` in SQL); a test's controlled clock moves it.
    ``deadline_passed`` is True when this step parked on a wait with a deadline
    and the run was re-queued because that deadline passed (rather than woken):
    the step runs again with the same ``effect_key`` and may now give up,
    escalate, or wait again.
    """

    def __init__(self, execution: ExecutionState, step: int, *, dry_run: bool = False) -> None:
        self._execution = execution
        self.run_id = execution.run_id
        self.root_run_id = execution.root_id
        self.app_id = execution.app_id
        self.step = step
        self.generation = execution.generation
        self.principal = execution.principal
        #: The abort signal: the run ended or changed hands under the step, or its
        #: action's timeout passed; what the step returns now is discarded. The kernel
        #: cancels an async hook on it (``hooks.call``).
        self.abort: threading.Event = execution.canceled
        #: Set when a cancel asked this run to stop (``tasks.cancel``,
        #: ``cancel_workflow_run``, #49): see ``cancel_asked``.
        self.cancel_requested: threading.Event = (
            getattr(execution, "cancel_requested", None) or threading.Event()
        )
        #: What an action reads: set on the abort signal, and once a cancel was asked
        #: (the step may stop early; what it returns then is still its result).
        self.canceled: threading.Event = CancelSignal(self.abort, self.cancel_requested)
        self.effect_key = f"{execution.run_id}:{step}"
        self.invocation_key: str | None = None
        self.dry_run = dry_run
        #: The database's clock decided it when it re-queued the run (a wake clears
        #: the deadline, a deadline leaves it): read from the row the claim loaded.
        self.deadline_passed = not dry_run and _deadline_passed(execution, step)
        #: TRANSACTIONAL only: the open ``transaction.atomic`` the journal commits in.
        self.tx: transaction.Atomic | None = None

    def __repr__(self) -> str:
        return f"<StepContext run={self.run_id} step={self.step} generation={self.generation}>"

    @property
    def using(self) -> str:
        return self._execution.using

    @property
    def run_row(self) -> WorkflowRun:
        """The run's row as its claim loaded it, to read, never to save: the kernel
        writes a run. A django.tasks task reads its worker and its failures there."""
        return self._execution.run

    def now(self) -> dt.datetime:
        """The kernel's current time (aware, UTC): what ``k2b_now()`` reads, with no query.

        Use it rather than ``timezone.now()`` to compare with a deadline: under
        ``k2b_workflows.testing.controlled_clock()`` (the ``k2b_clock`` fixture)
        it moves with the clock; in production it is ``timezone.now()``.
        """
        return clock.now()

    def heartbeat(self, tx: str | None = None) -> None:
        """Check that this execution still owns the run, and extend its lease.

        With ``tx`` (an alias inside an open ``transaction.atomic``): lock the run
        row until that block commits, so a takeover waits for it or it fails.
        Without: renew from a separate connection (never inside the run lock).
        Raises ``LeaseLost`` or ``RunCanceled``.
        """
        if self.dry_run:
            return
        lease = settings.lease_ms()
        if tx is not None:
            if tx != self.using:
                raise InvalidInput(f"heartbeat(tx={tx!r}): the run lives on {self.using!r}")
            if not connections[tx].in_atomic_block:
                raise InvalidInput("heartbeat(tx=...) must be called inside transaction.atomic")
            db.fence(tx, self.run_id, self.generation, lease)
            return
        if holds_run_lock():
            raise RuntimeError(
                "heartbeat() without tx while this thread holds the run lock would wait for itself;"
                " pass tx=ctx.tx.using"
            )
        # A connection of its own, closed at once: heartbeats are rare, and a
        # connection kept open would outlive the database it points to.
        with db.autocommit_connection(self.using) as conn:
            row = conn.execute(
                _HEARTBEAT_SQL,
                [lease, self.run_id, self.generation],
            ).fetchone()
            status = None
            if row is None:
                status = conn.execute(_STATUS_SQL, [self.run_id]).fetchone()
        if row is None:
            self.abort.set()
            if status and status[0] == "canceled":
                raise RunCanceled(f"run {self.run_id} was canceled")
            raise LeaseLost(f"run {self.run_id}: generation {self.generation} lost its lease")

    def cancel_asked(self, *, read: bool = False) -> bool:
        """Whether this step's call should stop: ``tasks.cancel`` asked it to (#49), or its
        run ended or changed hands under it.

        A worker's lease keeper sets the events within a tick, with no query here.
        Without a keeper (``testing.run_until_idle``), or with ``read``, the run's
        row is read when neither is set: a cancel committed since is seen at once.
        """
        if self.cancel_requested.is_set() or self.canceled.is_set():
            return True
        if self.dry_run or not (read or getattr(self._execution, "keeper", None) is None):
            return False
        with connections[self.using].cursor() as cursor:
            cursor.execute(_ASKED_SQL, [self.generation, self.run_id])
            row = cursor.fetchone()
        if row is not None and row[0]:
            self.cancel_requested.set()
        return row is None or row[0] or not row[1]

    @contextmanager
    def fenced(self, using: str = "default") -> Iterator[None]:
        """``transaction.atomic`` + ``heartbeat(tx)``.

        Writes inside the block commit only if this execution still owns the run.
        """
        with transaction.atomic(using=using), holding_run_lock():
            self.heartbeat(tx=using)
            yield

    def ai_task(self, provider: str, request: Any) -> Result:
        """Succeeded once the durable AI task is done, failed if it failed, else waiting on it."""
        if self.dry_run:  # a dry run creates no task and calls no provider
            return self._execution.ai_task(provider, request)  # type: ignore[attr-defined]
        return ai.step_task(self, provider, request)


class CancelSignal(threading.Event):
    """``ctx.canceled``: an event set when either of two is, the abort signal or the
    request to stop (#49). Setting it sets the abort signal."""

    #: How often ``wait`` looks at the request while it waits on the abort signal.
    POLL_S = 0.05

    def __init__(self, abort: threading.Event, asked: threading.Event) -> None:
        super().__init__()
        self._abort = abort
        self._asked = asked

    def is_set(self) -> bool:
        return self._abort.is_set() or self._asked.is_set()

    isSet = is_set  # threading.Event's old name

    def set(self) -> None:
        self._abort.set()

    def clear(self) -> None:
        self._abort.clear()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = self.POLL_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                break
            self._abort.wait(min(left, self.POLL_S))
        return self.is_set()


def _deadline_passed(execution: ExecutionState, step: int) -> bool:
    """Whether ``step`` parked with a deadline and the run was queued again because it passed.

    Every path from ``waiting`` back to ``queued`` but the deadline's clears
    ``wait_deadline`` (a wake, a wake already recorded when parking), and the
    next park of the run overwrites it: so a deadline still set on the claimed
    row, on this step, is one the database found due.
    """
    run = execution.run
    return run.wait_deadline is not None and run.wait_step == step


if TYPE_CHECKING:

    def _implements_the_protocol(ctx: KernelStepContext) -> StepContextProtocol:
        return ctx  # mypy checks here that the kernel's context is what actions are promised


#: The name the kernel's context had before the protocol took it; kept for existing imports.
StepContext = KernelStepContext
