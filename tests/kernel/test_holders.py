"""Whether the worker that called a provider may still be inside the call (#47), from the rows.

A takeover replaying an open dispatch waits while the worker its dispatch entry
names is present and nothing of that invocation was recorded since: every
entry after a dispatch (its late result, "outcome unknown", a reconcile's
answer or poll) is written once ``run()`` has returned. Here the worker's
presence is its heartbeat row; the presence lock is the process tests' part
(``tests/crash/test_live_holders.py``).
"""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from k2b_workflows import start_workflow_run
from k2b_workflows.kernel import db, evidence, holders
from k2b_workflows.models import WorkflowRun

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
