"""Helpers for users' own tests: run the real worker loop in the test's thread.

``run_until_idle`` claims and executes runs (and AI tasks) one at a time in
the calling thread, with the same kernel code as ``manage.py runworkflows``,
until nothing of the selected apps is runnable. Delayed retries are waited
for (they are part of "until idle"); waiting runs are not, unless their
deadline passes within ``timeout``; nor are a paused queue's runs (#49): it
returns with them queued.

Schedules' due ticks are fired on every round (their runs are then run like
any other): under ``controlled_clock``, ``clock.advance(hours=1)`` followed by
``run_until_idle()`` runs the hour's ticks as the schedule's ``catch_up``
says. It never moves the clock to a future tick by itself.

``controlled_clock`` moves the kernel's clock forward, so that a test passes
an hour of retry backoff, a day-long wait deadline or a lease expiry at once
instead of sleeping through it (or shortening it until it no longer tests the
real setting). Under it, ``run_until_idle`` moves the clock to what it waits
for instead of sleeping.

``crash_after_effect`` lets a test prove what its ``reconcile()`` is for: the
action's effect happens, then the "process dies" before the kernel hears the
result, exactly as a SIGKILL would leave it (the dispatch committed, no result,
a lease that runs out). ``assert_run_status`` and ``assert_effect_once`` fail
with the run's journal and ledger in the message, so a failing test says what
the run did.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import inspect
import math
import threading
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

from django.db import connections
from django.db.backends.signals import connection_created
from django.test import override_settings

from . import settings as k2b_settings
from .kernel import ai, claim, db, flow, hooks
from .kernel import clock as kernel_clock
from .kernel.execute import Execution
from .kernel.leases import LeaseKeeper
from .worker.loop import Worker

if TYPE_CHECKING:
    from .models import WorkflowRun


def run_until_idle(
    *,
    app_ids: Sequence[str] | None = None,
    timeout: float = 60.0,
    wait_for_deadlines: bool = False,
    using: str | None = None,
) -> Counter[str]:
    """Execute runnable runs until none is left; returns counts of outcomes.

    Raises ``TimeoutError`` when work is still runnable after ``timeout`` seconds
    (real seconds, whatever the clock does).

    Under ``controlled_clock()`` it does not sleep until a delayed retry (or,
    with ``wait_for_deadlines``, a wait deadline) is due: it moves the clock
    to that moment, so an hour of backoff takes no time.
    """
    using = using or k2b_settings.database()
    worker = Worker(app_ids=app_ids, using=using, listen=False)
    # A simulated crash stands for a dead process, and the reap that takes its run
    # over for another worker's: it must count the crash (#38), not forgive it as
    # a lease its own live worker renewed too late.
    worker.housekeeping.worker_id = ""
    keeper = LeaseKeeper(using)
    keeper.start()
    stats: Counter[str] = Counter()
    deadline = time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"run_until_idle: still busy after {timeout} s ({dict(stats)})")
            worker.housekeeping.run(0)  # a poll of 0: every call is a pass
            if scheduled := worker.fire_schedules(force=True):
                stats["scheduled"] += scheduled
            runs, loaded, tasks = worker.claim(1)
            for run_id, generation in runs:
                execution = Execution(
                    run_id, generation, using=using, keeper=keeper, preloaded=loaded.get(run_id)
                )
                try:
                    stats[str(execution.execute())] += 1  # the value, as the worker counts
                except SimulatedCrash:
                    # A dead process renews nothing: a renewal of the keeper's in
                    # flight must not land after the expiry (seen on a loaded
                    # machine: the run stayed "running" and run_until_idle returned).
                    with keeper.paused():
                        keeper.untrack(run_id)
                        _expire_lease(using, run_id, generation)
                    stats["crashed"] += 1
                stats["runs"] += 1
                stats["steps"] += execution.steps_executed
            for task in tasks:
                abort = threading.Event()
                keeper.track_task(task[0], task[1], abort)
                try:
                    stats["ai_" + ai.run_task(using, task, abort)] += 1
                finally:
                    keeper.untrack_task(task[0])
            if runs or tasks:
                continue
            if worker.selection.pending(using, worker.housekeeping.admitted_until):
                if _active_clock is not None and _active_clock._skip_ms(
                    _next_retry_ms(using, worker)
                ):
                    continue
                due = claim.next_due_in_ms(using) or 0
                time.sleep(min(max(due / 1000, 0.005), 0.2))
                continue
            if wait_for_deadlines and _next_deadline_ms(using) is not None:
                if _active_clock is not None and _active_clock._skip_ms(_next_deadline_ms(using)):
                    continue
                time.sleep(min(max((_next_deadline_ms(using) or 0) / 1000, 0.005), 0.2))
                continue
            return stats
    finally:
        keeper.stop()


#: The next due run of these workflows (``{app_filter}``: of these apps too), in a
#: queue that is not paused.
_NEXT_RETRY_SQL = f"""
SELECT EXTRACT(EPOCH FROM (min(run_after) - k2b_now())) * 1000 FROM k2b_run
 WHERE ((status = 'queued' AND {flow.CLAIMABLE}) OR {flow.DELAYED_KEYED}) AND {flow.NOT_PAUSED}
   AND (workflow_name, workflow_version)
       IN (SELECT * FROM unnest(%s::text[], %s::int[])) {{app_filter}}
"""
_APP_FILTER = "AND app_id = ANY(%s)"


def _next_retry_ms(using: str, worker: Worker) -> float | None:
    """Milliseconds until the next queued run this worker may claim is due (None: none).

    Only what ``run_until_idle`` waits for: not another app's retries, not a
    lease some other (dead) worker still holds, not a wait deadline.
    """
    workflows = worker.selection.workflows()
    params: list[Any] = [[n for n, _ in workflows], [v for _, v in workflows]]
    app_filter = ""
    if worker.app_ids:
        app_filter = _APP_FILTER
        params.append(list(worker.app_ids))
    with connections[using].cursor() as cursor:
        cursor.execute(_NEXT_RETRY_SQL.format(app_filter=app_filter), params)
        value = cursor.fetchone()[0]
    return None if value is None else max(0.0, float(value))


_NEXT_DEADLINE_SQL = (
    "SELECT EXTRACT(EPOCH FROM (min(wait_deadline) - k2b_now())) * 1000"
    " FROM k2b_run WHERE status = 'waiting' AND wait_deadline IS NOT NULL"
)


def _next_deadline_ms(using: str) -> float | None:
    from django.db import connections

    with connections[using].cursor() as cursor:
        cursor.execute(_NEXT_DEADLINE_SQL)
        value = cursor.fetchone()[0]
    return None if value is None else max(0.0, float(value))


class SimulatedCrash(BaseException):
    """Raised by an action under ``crash_after_effect`` after its effect.

    A BaseException, like the kernel's own control flow, so that no
    ``except Exception`` in the kernel or in workflow code can treat it as an
    ordinary failure: the step is left exactly where a killed process leaves it.
    """


_EXPIRE_LEASE_SQL = (
    "UPDATE k2b_run SET lease_expires_at = k2b_now() - interval '1 ms'"
    " WHERE id = %s AND generation = %s AND status = 'running'"
)


def _expire_lease(using: str, run_id: uuid.UUID, generation: int) -> None:
    """What the dead process leaves behind: its lease runs out, nothing else changes."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            _EXPIRE_LEASE_SQL,
            [run_id, generation],
        )


@contextlib.contextmanager
def crash_after_effect(action: Any, *, times: int = 1) -> Iterator[list[Any]]:
    """Make the next ``times`` calls of ``action.run()`` crash right after their effect.

    Inside the block, ``run()`` runs for real and then raises ``SimulatedCrash``
    instead of returning its result to the kernel. ``run_until_idle`` treats
    that as the worker process dying: nothing more is written, the run's lease
    expires and the run is taken over as after a SIGKILL. An EXTERNAL action is
    then reconciled (``reconcile()``, or an incident without one), never re-run;
    an IDEMPOTENT one runs again with the same ``effect_key``; a TRANSACTIONAL
    one was rolled back with its journal entry. Yields the list of the results
    ``run()`` returned before each crash.

    ``action`` may also be a django.tasks task (what ``@task`` made): its calls
    crash once the function has returned (or raised), as if the worker died
    before it could record the answer; an external task is then reconciled
    (its ``reconcile``, or an incident), a pure or idempotent one runs again.
    """
    path = getattr(action, "module_path", None)
    if path is not None and not isinstance(action, type):
        from .tasks import runs as task_runs

        owner: Any = task_runs.TaskAction
    else:
        owner = action
    original = owner.__dict__.get("run")
    if original is None:
        raise TypeError(f"{getattr(action, '__name__', action)!r} does not define run()")
    remaining = [times]
    lost: list[Any] = []
    name = path or action.__name__

    def run(self: Any, ctx: Any, input: Any) -> Any:
        result = original(self, ctx, input)
        if inspect.iscoroutine(result):  # an async def run(): its effect happens here
            result = hooks.run_coroutine(result, ctx.abort)
        if path is not None and input.get("task") != path:
            return result  # another task's call
        if remaining[0] > 0:
            remaining[0] -= 1
            lost.append(result)
            raise SimulatedCrash(f"{name}: run() crashed after its effect")
        return result

    owner.run = run
    try:
        yield lost
    finally:
        owner.run = original


@contextlib.contextmanager
def fast_retries(backoff_ms: int = 1) -> Iterator[None]:
    """Retry backoff of ``backoff_ms`` inside the block, other settings unchanged.

    Retries back off exponentially from ``RETRY_BACKOFF_MS`` (one second by
    default), which ``run_until_idle`` waits out; tests of retry paths need not.
    """
    from django.conf import settings

    current = dict(getattr(settings, "K2B_WORKFLOWS", {}))
    with override_settings(K2B_WORKFLOWS={**current, "RETRY_BACKOFF_MS": backoff_ms}):
        yield


class WorkflowClock:
    """The kernel's clock in a test: real time plus an offset that only moves forward.

    Everything the kernel times follows it: lease expiry, retry backoff
    (``RETRY_BACKOFF_MS``), wait and reconcile deadlines, AI task leases,
    action timeouts, worker heartbeats, and the times it stamps on runs,
    journal and ledger entries. The database's clock (``k2b_now()``) and the
    kernel's Python reads move together, so no deadline has passed on one
    and not on the other. Real time keeps running underneath: the clock is
    never frozen, so nothing that waits on it hangs.

    Get one from ``controlled_clock()`` (or the ``k2b_clock`` fixture of
    ``k2b_workflows.pytest_plugin``).
    """

    def __init__(self) -> None:
        self._offset = dt.timedelta(0)
        #: Django's psycopg connections this clock pushed its offset to.
        self._django: weakref.WeakSet[Any] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"<WorkflowClock now={self.now().isoformat()} offset={self._offset}>"

    @property
    def offset(self) -> dt.timedelta:
        """How far ahead of real time the clock is."""
        return self._offset

    def now(self) -> dt.datetime:
        """The kernel's time now (aware): what it compares deadlines and leases with."""
        return kernel_clock.now()

    def advance(
        self,
        delta: dt.timedelta | None = None,
        *,
        days: float = 0,
        hours: float = 0,
        minutes: float = 0,
        seconds: float = 0,
        milliseconds: float = 0,
    ) -> dt.datetime:
        """Move the clock forward (``advance(hours=1)`` or ``advance(timedelta(...))``).

        Every deadline, backoff and lease that ends within the step is due
        when this returns: the next ``run_until_idle()`` treats it as such.
        Returns the new ``now()``. Call it from the test, not from inside an
        action: a transaction of the kernel's that rolls back would take the
        new time back with it.
        """
        step = (delta or dt.timedelta(0)) + dt.timedelta(
            days=days, hours=hours, minutes=minutes, seconds=seconds, milliseconds=milliseconds
        )
        if step < dt.timedelta(0):
            raise ValueError(f"the clock only moves forward (advance by {step})")
        self._move(self._offset + step)
        return self.now()

    def advance_to(self, when: dt.datetime) -> dt.datetime:
        """Move the clock forward to ``when`` (aware), e.g. a run's ``wait_deadline``.

        Does nothing when ``when`` has already passed. Returns the new ``now()``.
        """
        left = when - self.now()
        if left > dt.timedelta(0):
            self.advance(left)
        return self.now()

    def _skip_ms(self, ms: float | None) -> bool:
        """``run_until_idle``'s wait: to the moment something is due. False: it is due now."""
        if not ms:
            return False
        self.advance(dt.timedelta(microseconds=math.ceil(ms * 1000)))
        return True

    def _move(self, offset: dt.timedelta) -> None:
        self._offset = offset
        conns = _django_connections()
        self._django.update(conns)
        kernel_clock.set_offset(offset, extra=conns)

    def _follow(self, sender: Any, connection: Any, **kwargs: Any) -> None:
        """``connection_created``: a connection opened while the clock runs follows it."""
        if connection.vendor == "postgresql" and connection.connection is not None:
            self._django.add(connection.connection)
            kernel_clock.follow(connection.connection)


def _django_connections() -> list[Any]:
    """This thread's open PostgreSQL connections (psycopg objects) of every alias."""
    return [
        wrapper.connection
        for wrapper in connections.all(initialized_only=True)
        if wrapper.vendor == "postgresql" and wrapper.connection is not None
    ]


_active_clock: WorkflowClock | None = None


@contextlib.contextmanager
def controlled_clock() -> Iterator[WorkflowClock]:
    """Run the block on a ``WorkflowClock`` the test moves with ``advance()``.

    ``with controlled_clock() as clock: ...; clock.advance(hours=1); run_until_idle()``
    passes an hour of retry backoff without sleeping, with the settings your
    production runs with. The offset is a session setting (``k2b.clock_offset``)
    that ``k2b_now()`` adds to the database's time while the block runs (the
    owner alias switches that on in the test database, and off on exit:
    in production ``k2b_now()`` reads no setting). It is set on this thread's
    open connections, on every connection opened while the block runs (any
    thread), and on the kernel's own connections (the lease keeper's, the
    heartbeat's). A connection another thread had open before the block keeps
    real time: start in-process workers inside it, or use ``run_until_idle``.
    On exit the clock is back to real time everywhere. Not nestable.
    """
    global _active_clock
    if _active_clock is not None:
        raise RuntimeError("a controlled_clock() is already running; move that one")
    active = WorkflowClock()
    _honour_offset(True)
    connection_created.connect(active._follow, weak=False)
    _active_clock = active
    try:
        active._move(dt.timedelta(0))
        yield active
    finally:
        _active_clock = None
        connection_created.disconnect(active._follow)
        conns = _django_connections()
        active._django.update(conns)
        kernel_clock.set_offset(dt.timedelta(0), extra=conns)
        kernel_clock.forget(list(active._django))
        _honour_offset(False)


def _honour_offset(honour: bool) -> None:
    """Switch ``k2b_now()``'s offset on (off) in the test database, as its owner.

    In production ``k2b_now()`` reads no session setting: any session could
    set one (#35). The owner alias created the test database's functions, so
    it may replace this one; committed at once, on a connection of its own,
    so that the kernel's other connections see it.
    """
    conn = db.autocommit_connection(k2b_settings.owner_database(), follow_clock=False)
    try:
        kernel_clock.honour_offset(conn, honour)
    finally:
        conn.close()


def _run_id(run_or_id: WorkflowRun | uuid.UUID | str) -> uuid.UUID:
    """The id of a run given as itself or its id. Django takes the id as text as well,
    which django-stubs' lookups do not describe: hence the cast."""
    return cast(uuid.UUID, getattr(run_or_id, "pk", run_or_id))


def describe_run(run_or_id: WorkflowRun | uuid.UUID | str) -> str:
    """The run's status, error, journal and ledger as text, for a failing assertion."""
    from .models import JournalEntry, LedgerEntry, WorkflowRun

    run_id = _run_id(run_or_id)
    run = WorkflowRun.objects.filter(pk=run_id).first()
    if run is None:
        return f"run {run_id}: no such run"
    lines = [
        f"run {run.pk} ({run.workflow_name}): {run.status}"
        + (f" {run.error_code}: {run.error_message}" if run.error_code else "")
        + f", generation {run.generation}, consecutive failures {run.consecutive_failures}",
        "journal:",
    ]
    for entry in JournalEntry.objects.filter(run_id=run.pk).order_by("seq"):
        lines.append(f"  step {entry.seq} {entry.action_name}: {entry.state}")
    lines.append("ledger:")
    for noted in LedgerEntry.objects.filter(run_id=run.pk).order_by("id"):
        step = "-" if noted.seq is None else noted.seq
        message = f" ({noted.message})" if noted.message else ""
        lines.append(
            f"  step {step} {noted.kind} {noted.action_name} gen {noted.generation}{message}"
        )
    return "\n".join(lines)


def assert_run_status(
    run_or_id: WorkflowRun | uuid.UUID | str, status: str, *, error_code: str | None = None
) -> None:
    """Fail unless the run is in ``status`` (and has ``error_code``), showing what it did."""
    from .models import WorkflowRun

    run = WorkflowRun.objects.get(pk=_run_id(run_or_id))
    if run.status != status or (error_code is not None and run.error_code != error_code):
        wanted = status + (f" with {error_code}" if error_code else "")
        raise AssertionError(f"expected {wanted}\n{describe_run(run)}")


def assert_effect_once(run_or_id: WorkflowRun | uuid.UUID | str, step: int) -> None:
    """Fail unless the EXTERNAL (or stronger) step ``step`` was dispatched exactly once
    and its outcome is settled (succeeded, reconciled or confirmed by an operator).

    The ledger records every dispatch before ``run()`` is called, so this holds
    across crashes: a step reconciled after a crash still shows one dispatch.
    IDEMPOTENT steps may run again by design (with the same ``effect_key``);
    count their effects in your own dedup table instead.
    """
    from .models import JournalEntry, LedgerEntry

    run_id = _run_id(run_or_id)
    dispatched = LedgerEntry.objects.filter(
        run_id=run_id, seq=step, kind=LedgerEntry.Kind.DISPATCHED
    ).count()
    settled = JournalEntry.objects.filter(
        run_id=run_id, seq=step, state=JournalEntry.State.SUCCEEDED
    ).exists()
    if dispatched != 1 or not settled:
        raise AssertionError(
            f"expected step {step} dispatched once and settled; dispatched {dispatched}"
            f" time(s), settled: {settled}\n{describe_run(run_id)}"
        )
