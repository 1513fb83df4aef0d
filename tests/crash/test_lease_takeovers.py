"""What a takeover counts against the run, with real worker processes (#38).

A lease that expires under a worker that still beats was lost by a live
process whose keeper renewed too late (a starved host; a row its renewal had
to skip): the run is taken over and fenced as always, but the takeover is not
one of its consecutive failures, once per step. A worker's own reaper leaves
the runs it executes in time to its keeper. A worker that dies or freezes
cannot prove it is alive, and its takeover counts; a live loss repeated at the
same step counts: a run that kills or hangs every worker that claims it still
exhausts its retries.
"""

from __future__ import annotations

import json
import signal

import pytest
from django.db import connection, transaction

from k2b_workflows import start_workflow_run
from k2b_workflows.kernel import claim
from k2b_workflows.store import WORKFLOW_RETRY_EXHAUSTED
from tests.models import ProviderCall
from tests.support.kernel import SETTLED, describe, fresh

pytestmark = [pytest.mark.crash, pytest.mark.django_db(transaction=True)]

TIMEOUT = 90  # generous: the machine is shared; nothing here is a timing assertion
MAX_FAILURES = 3
SETTINGS = {
    "RUN_LEASE_MS": 1500,
    "RETRY_BACKOFF_MS": 50,
    "RUN_MAX_CONSECUTIVE_FAILURES": MAX_FAILURES,
}


def env(**extra: str) -> dict[str, str]:
    return {"K2B_TEST_SETTINGS": json.dumps(SETTINGS), **extra}


def calls(action: str) -> list[tuple[int, int]]:
    """(generation, pid) of each time ``action`` was called, in order."""
    return list(
        ProviderCall.objects.filter(action=action).order_by("id").values_list("generation", "pid")
    )


def lapsed_while_its_holder_beats(run_id: object) -> bool:
    """The lease has expired, and the worker holding it has beaten since."""
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT r.lease_expires_at < k2b_now() AND w.heartbeat_at > r.lease_expires_at
                 FROM k2b_run r JOIN k2b_worker w ON w.worker_id = r.claimed_by
                WHERE r.id = %s AND r.status = 'running'""",
            [run_id],
        )
        row = cursor.fetchone()
    return bool(row and row[0])


def test_a_live_worker_whose_keeper_renewed_too_late_loses_the_run_without_a_failure(
    start_worker, wait
):
    run = start_workflow_run("kernel.slow", {"seconds": 4})
    worker = start_worker("--concurrency", "1", env=env())
    wait(
        lambda: calls("kernel.slow"),
        timeout=TIMEOUT,
        message=lambda: f"the step to start:\n{worker.report()}",
    )
    with transaction.atomic():
        # Locked here, the row is skipped by the keeper's renewal, as a row locked by a
        # long step transaction of its own is: the lease lapses while the worker beats.
        # The reaper skips it too, until this transaction reaps it itself.
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM k2b_run WHERE id = %s FOR UPDATE", [run.pk])
        wait(
            lambda: lapsed_while_its_holder_beats(run.pk),
            timeout=TIMEOUT,
            message=lambda: f"the lease to lapse under a beating worker:\n{worker.report()}",
        )
        assert claim.reap_expired("default") == 1
    taken = fresh(run)  # queued, or claimed again already
    assert taken.consecutive_failures == 0, taken.error_message
    assert taken.error_message.startswith("lease lost by a live worker"), taken.error_message

    wait(
        lambda: fresh(run).status in SETTLED,
        timeout=TIMEOUT,
        message=lambda: f"the run to settle:\n{worker.report()}",
    )
    assert fresh(run).status == "succeeded", describe(run)
    # The same live process ran it again under the next generation; its first
    # attempt's late write was refused by the fence, as after any takeover.
    assert calls("kernel.slow") == [(1, worker.pid), (2, worker.pid)]
    assert "generation 1 no longer holds the lease" in worker.output()


def test_a_worker_whose_keeper_cannot_keep_up_still_finishes_its_runs(start_worker, wait):
    """A lease shorter than the keeper's tick (0.25 s): every lease expires under a live
    worker, as under a keeper starved for longer than a lease. Its own reaper took
    its runs from it and counted each time, and every run ended
    WORKFLOW_RETRY_EXHAUSTED (16 of 16 in a trial); now it leaves them to it."""
    starved = {**SETTINGS, "RUN_LEASE_MS": 150, "RUN_MAX_CONSECUTIVE_FAILURES": 5}
    runs = [start_workflow_run("kernel.slow", {"seconds": 1}) for _ in range(4)]
    worker = start_worker("--concurrency", "4", env={"K2B_TEST_SETTINGS": json.dumps(starved)})
    wait(
        lambda: all(fresh(run).status in SETTLED for run in runs),
        timeout=TIMEOUT,
        message=lambda: f"the runs to settle:\n{worker.report()}",
    )
    assert {fresh(run).status for run in runs} == {"succeeded"}, [describe(r) for r in runs]
    assert len(calls("kernel.slow")) == len(runs)


def test_a_run_that_kills_every_worker_that_claims_it_still_exhausts_its_retries(
    start_worker, wait
):
    run = start_workflow_run("test.pure", {"a": 1, "b": 2, "crash": "pure"})
    crashing = env(K2B_TEST_CRASH="pure")
    # Two at a time, each replaced when it dies: the survivor reaps the dead one's
    # lease soon after it expires, while the dead one's last heartbeat is recent.
    workers = [start_worker("--concurrency", "1", env=crashing) for _ in range(2)]
    killed = []

    def replace_the_dead_and_see_if_settled() -> bool:
        for i, worker in enumerate(workers):
            if worker.proc.poll() is not None:
                killed.append(worker.proc.returncode)
                workers[i] = start_worker("--concurrency", "1", env=crashing)
        return fresh(run).status in SETTLED

    wait(
        replace_the_dead_and_see_if_settled,
        timeout=TIMEOUT,
        message=lambda: f"the run to exhaust ({describe(run)}):\n{workers[0].report()}",
    )
    state = describe(run)
    assert (state["status"], state["code"]) == ("failed", WORKFLOW_RETRY_EXHAUSTED), state
    assert killed == [-signal.SIGKILL] * MAX_FAILURES, killed


def test_an_action_that_overruns_its_timeout_every_time_still_exhausts_its_retries(
    start_worker, wait
):
    """The worker stays alive and beating throughout: the first takeover at the step is
    taken for a late keeper and not counted, every later one with no step done since is."""
    run = start_workflow_run("kernel.overrun", {"seconds": 4})
    worker = start_worker("--concurrency", "4", env=env())
    wait(
        lambda: fresh(run).status in SETTLED,
        timeout=TIMEOUT,
        message=lambda: f"the run to exhaust ({describe(run)}):\n{worker.report()}",
    )
    state = describe(run)
    assert (state["status"], state["code"]) == ("failed", WORKFLOW_RETRY_EXHAUSTED), state
    assert calls("kernel.overrun") == [(g, worker.pid) for g in range(1, MAX_FAILURES + 2)]
    assert worker.proc.poll() is None, worker.report()
