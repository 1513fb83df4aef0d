"""Whether the worker that called a provider may still be inside the call (#47), from the rows.

A takeover replaying an open dispatch waits while the worker its dispatch entry
names is present and nothing of that invocation was recorded since: every
entry after a dispatch (its late result, "outcome unknown", a reconcile's
answer or poll) is written once ``run()`` has returned. Here the worker's
presence is its heartbeat row, or a lease keeper of this process with its
locks; a worker process is the process tests' part
(``tests/crash/test_live_holders.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from django.db import connection, transaction

from k2b_workflows import start_workflow_run
from k2b_workflows.kernel import db, evidence, holders
from k2b_workflows.kernel.leases import LeaseKeeper
from k2b_workflows.models import WorkflowRun
from tests.support.processes import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

_WORKER_SQL = """
INSERT INTO k2b_worker (worker_id, host, pid, started_at, heartbeat_at, state,
                        concurrency, apps, workflows, in_flight)
VALUES (%s, 'h', 1, now(), now() - %s * interval '1 second', 'alive', 1, '[]', '[]', 0)
"""


def beating(worker_id: str, seconds_ago: int = 0) -> None:
    with connection.cursor() as cursor:
        cursor.execute(_WORKER_SQL, [worker_id, seconds_ago])


def noted(run: WorkflowRun, kind: str, key: str, worker: str | None = None) -> None:
    with transaction.atomic():
        db.lock_run("default", run.pk)
        evidence.append_ledger(
            "default",
            run_id=run.pk,
            seq=0,
            kind=kind,
            invocation_key=key,
            detail={"worker": worker} if worker else None,
        )


def in_call(run: WorkflowRun, key: str = "k:1") -> str | None:
    return holders.still_in_call("default", run.pk, 0, key)


def test_the_worker_of_an_open_call_is_waited_for_until_anything_of_that_call_is_noted():
    run = start_workflow_run("holders.charge", {})
    beating("w-live")
    noted(run, "dispatched", "k:1", worker="w-live")
    assert in_call(run) == "w-live"
    noted(run, "pending", "k:0")  # another invocation's: not this call's answer
    assert in_call(run) == "w-live"
    noted(run, "outcome_unknown", "k:1")  # run() returned: its answer was doubt
    assert in_call(run) is None


def test_a_worker_gone_or_unnamed_is_not_waited_for():
    run = start_workflow_run("holders.charge", {})
    beating("w-silent", seconds_ago=3600)
    noted(run, "dispatched", "k:1", worker="w-silent")
    assert in_call(run) is None
    noted(run, "dispatched", "k:2", worker="w-unknown")
    assert in_call(run, "k:2") is None
    noted(run, "dispatched", "k:3")  # a dispatch of a release that named no worker
    assert in_call(run, "k:3") is None


@pytest.fixture
def keeper() -> Iterator[LeaseKeeper]:
    """A worker's lease keeper, connected: it holds the presence and reporting locks."""
    keeper = LeaseKeeper("default", worker_id="w-keeper")
    assert keeper.connect() and keeper.present.is_set()
    try:
        yield keeper
    finally:
        keeper.stop()


def test_a_live_worker_out_of_the_call_is_not_waited_for(keeper):
    """What a failover to an asynchronous standby leaves: the dispatch committed on the
    new primary, the answer on the old one only, and the worker alive. Present is not
    inside: waited for, the run was deferred for ever (by its own worker, too)."""
    run = start_workflow_run("holders.charge", {})
    beating("w-keeper")
    noted(run, "dispatched", "k:1", worker="w-keeper")
    assert in_call(run) is None
    with keeper.calling(run.pk):
        assert in_call(run) == "w-keeper"
        other = start_workflow_run("holders.charge", {})
        noted(other, "dispatched", "k:1", worker="w-keeper")
        assert in_call(other) is None  # a call lock is the run's, not the worker's
    # Given back with the next call's lock or at the keeper's next tick: a moment late,
    # which makes a takeover wait, never race.
    assert in_call(run) == "w-keeper"
    keeper.tick(renew=False)
    assert in_call(run) is None


def test_a_call_left_keeps_its_lock_while_its_run_executes_and_gives_it_back_after(keeper):
    """Left, a call has returned, but its outcome commits with the step after: a holder
    starved in between was taken over as out of the call, and the answer it was about
    to commit became an incident (seen in the starvation soak)."""
    run = start_workflow_run("holders.charge", {})
    beating("w-keeper")
    noted(run, "dispatched", "k:1", worker="w-keeper")
    keeper.track(run.pk, 1, threading.Event())
    with keeper.calling(run.pk):
        pass
    keeper.tick(renew=False)
    assert in_call(run) == "w-keeper", "given back before the call's outcome committed"
    keeper.untrack(run.pk)  # the run ended, or was handed back
    keeper.tick(renew=False)
    assert in_call(run) is None


def test_a_keepers_next_call_gives_the_last_ones_lock_back_in_the_same_statement(keeper):
    first, second = (start_workflow_run("holders.charge", {}) for _ in range(2))
    for run in (first, second):
        noted(run, "dispatched", "k:1", worker="w-keeper")
    with keeper.calling(first.pk):
        pass
    with keeper.calling(second.pk):
        assert in_call(first) is None
        assert in_call(second) == "w-keeper"
    with keeper.calling(first.pk):  # the same run again while its lock is given back
        assert in_call(first) == "w-keeper"
        assert in_call(second) is None


def test_a_keeper_that_reconnects_inside_a_call_locks_it_before_it_reports(keeper):
    run = start_workflow_run("holders.charge", {})
    beating("w-keeper")
    noted(run, "dispatched", "k:1", worker="w-keeper")
    with keeper.calling(run.pk):
        keeper._drop_connection()
        # Between two connections: no lock at all, the fresh heartbeat keeps it inside.
        assert in_call(run) == "w-keeper"
        assert keeper.connect() and keeper._reporting
        assert in_call(run) == "w-keeper"
    keeper.tick(renew=False)
    assert in_call(run) is None


def test_a_call_entered_before_the_keeper_reports_is_locked_when_it_does():
    """A keeper that could not take the reporting lock yet (a takeover held it a moment)
    locks the calls entered meanwhile before it takes it."""
    run = start_workflow_run("holders.charge", {})
    noted(run, "dispatched", "k:1", worker="w-late")
    keeper = LeaseKeeper("default", worker_id="w-late")
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            held = holders.REPORTING_LOCK.format(worker="%s")
            cursor.execute(f"SELECT pg_catalog.pg_advisory_xact_lock({held})", ["w-late"])
            assert keeper.connect() and keeper.present.is_set() and not keeper._reporting
            with keeper.calling(run.pk):
                pass
            calling = keeper.calling(run.pk)
            calling.__enter__()
        assert keeper.connect() and keeper._reporting
        assert in_call(run) == "w-late"
        calling.__exit__(None, None, None)
        keeper.tick(renew=False)
        assert in_call(run) is None
    finally:
        keeper.stop()


def test_a_worker_that_reports_no_calls_is_inside_while_present():
    """A worker of an older release holds its presence lock and no call locks: waited
    for while present, as before (a wait too long, never a race)."""
    run = start_workflow_run("holders.charge", {})
    noted(run, "dispatched", "k:1", worker="w-old")
    with db.autocommit_connection("default") as old:
        presence = holders.PRESENCE_LOCK.format(worker="%s")
        old.execute(f"SELECT pg_catalog.pg_advisory_lock({presence})", ["w-old"])
        assert in_call(run) == "w-old"
    # The lock goes with the session, which the server ends a moment after the close.
    wait_for(lambda: in_call(run) is None, message="the presence lock released")
