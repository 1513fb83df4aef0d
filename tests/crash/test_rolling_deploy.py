"""A rolling deploy with real worker processes running different code.

``K2B_TEST_CODE`` selects which versions of ``ver.checkout`` a worker process
registers, as two deploys would; ``K2B_TEST_PATCH`` selects the old or the
patched code of ``ver.patched`` (see ``tests/workflows/versions.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from django.db import connection

from k2b_workflows import fleet, start_workflow_run, wake_workflow_runs_waiting_on
from tests.models import DomainRow, ProviderCall
from tests.support.kernel import assert_invariants, describe, fresh, journal
from tests.support.processes import ROOT
from tests.workflows.versions import PATCH_ID

pytestmark = [pytest.mark.crash, pytest.mark.django_db(transaction=True)]

TIMEOUT = 90  # generous: the machine is shared; nothing here is a timing assertion


def wake(key: str) -> None:
    DomainRow.objects.get_or_create(key=key)
    wake_workflow_runs_waiting_on(app_id="versions", kind="signal", key=key)


def status_is(run, *statuses):
    return lambda: fresh(run).status in statuses


def worker_with(start_worker, code: str, **env: str):
    return start_worker(
        "--concurrency", "2", "--app", "versions", env={"K2B_TEST_CODE": code, **env}
    )


def stop(worker) -> None:
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()


def workflowruns_as(code: str) -> str:
    """``manage.py workflowruns`` run by a process of the given deploy."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "K2B_TEST_DB_NAME": connection.settings_dict["NAME"],
        "K2B_TEST_CODE": code,
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "workflowruns", "--app", "versions"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=True,
    )
    return done.stdout


def test_v1_runs_finish_on_v1_workers_while_v2_runs_start_beside_them(start_worker, wait):
    old = worker_with(start_worker, "v1")
    early = start_workflow_run("ver.checkout", {"key": "early"}, version=1)
    parked = start_workflow_run("ver.checkout", {"key": "parked"}, version=1)
    for run in (early, parked):
        wait(status_is(run, "waiting"), timeout=TIMEOUT, message=f"{run.pk} to park")

    # The deploy: a worker with only version 2 joins; new runs start on version 2.
    new = worker_with(start_worker, "v2")
    fresh_runs = [start_workflow_run("ver.checkout", {"key": "go-v2"}) for _ in range(3)]
    assert {r.workflow_version for r in fresh_runs} == {2}
    wake("go-v2")
    wake("early")
    for run in (early, *fresh_runs):
        wait(status_is(run, "succeeded"), timeout=TIMEOUT, message=f"{run.pk}: {describe(run)}")
    assert fresh(early).output == {"version": 1, "finished_on": "v1", "pid": old.pid}
    for run in fresh_runs:
        assert fresh(run).output == {"version": 2, "finished_on": "v2", "pid": new.pid}

    # The old workers go; a version 1 run woken now has no worker: reported, not lost.
    stop(old)
    # Its generation now: on a loaded machine the old worker may have lost a lease to
    # itself before it parked (a takeover, generation 2); what matters is that no
    # worker claims it from here on.
    generation = fresh(parked).generation
    wake("parked")
    assert fresh(parked).status == "queued"
    later = start_workflow_run("ver.checkout", {"key": "go-v2"})
    wait(status_is(later, "succeeded"), timeout=TIMEOUT, message="the v2 worker to work on")
    stuck = fresh(parked)
    assert (stuck.status, stuck.generation) == ("queued", generation), describe(parked)
    report = workflowruns_as("v2")
    assert f"run {parked.pk} (ver.checkout v1): no live worker has code for version 1" in report
    unserved = fleet.status()["unserved"]  # what manage.py workflowstatus reports
    assert [(u["workflow"], u["version"], u["queued"]) for u in unserved] == [
        ("ver.checkout", 1, 1)
    ]

    # A version 1 worker comes back (a rollback, or old workers kept to drain): it finishes.
    back = worker_with(start_worker, "v1")
    wait(status_is(parked, "succeeded"), timeout=TIMEOUT, message=f"{describe(parked)}")
    assert fresh(parked).output == {"version": 1, "finished_on": "v1", "pid": back.pid}
    runs = [early, parked, *fresh_runs, later]
    print("\nrolling deploy: run, version, worker that finished it")
    for run in runs:
        run = fresh(run)
        who = {old.pid: "v1 worker", new.pid: "v2 worker", back.pid: "v1 worker (back)"}
        print(f"  {run.pk}  v{run.workflow_version}  {run.status}  {who[run.output['pid']]}")
    print(report)
    assert_invariants()


def test_patched_branches_hold_for_old_and_new_runs_across_a_sigkill(start_worker, wait):
    def patched_run(name: str, *, k1_done: bool, crash: str | None = None):
        if k1_done:
            DomainRow.objects.create(key=f"{name}-k1")
        return start_workflow_run(
            "ver.patched", {"k1": f"{name}-k1", "k2": f"{name}-k2", "crash": crash}
        )

    old = worker_with(start_worker, "v1", K2B_TEST_PATCH="old")
    passed = patched_run("passed", k1_done=True)  # passes the patch point on the old code
    before = patched_run("before", k1_done=False)  # parks before it
    for run in (passed, before):
        wait(status_is(run, "waiting"), timeout=TIMEOUT, message=f"{run.pk} to park")
    stop(old)

    # The patched code; its first worker is killed inside the new branch's step.
    crashing = worker_with(start_worker, "v1", K2B_TEST_PATCH="new", K2B_TEST_CRASH="stamp")
    new = patched_run("new", k1_done=True, crash="stamp")
    assert crashing.wait(timeout=TIMEOUT) == -signal.SIGKILL, crashing.output()
    # The patch's marker rides with the PURE stamp's success on the run's next write
    # (it is committed before any step that is not PURE): killed inside the stamp,
    # neither committed, and the run is taken over as if it never reached the patch.
    assert f"k2b.patch:{PATCH_ID}" not in [e.action_name for e in journal(new)]

    healthy = worker_with(start_worker, "v1", K2B_TEST_PATCH="new")
    wait(status_is(new, "waiting"), timeout=TIMEOUT, message=f"{describe(new)}")
    for key in ("passed-k2", "before-k1", "before-k2", "new-k2"):
        wake(key)
    for run in (passed, before, new):
        wait(status_is(run, "succeeded"), timeout=TIMEOUT, message=f"{describe(run)}")
    assert fresh(passed).output == {"branch": "old"}
    assert fresh(before).output == {"branch": "new"}
    assert fresh(new).output == {"branch": "new"}
    marker = f"k2b.patch:{PATCH_ID}"
    for run, expected in ((passed, []), (before, [2]), (new, [2])):
        assert [e.seq for e in journal(run) if e.action_name == marker] == expected
    # The old run's step b ran once, on the old worker; the replays never ran it again.
    old_b = [
        c for c in ProviderCall.objects.filter(action="ver.stamp") if c.payload["at"] == "old-b"
    ]
    assert [(c.payload["run"], c.pid) for c in old_b] == [(str(passed.pk), old.pid)]
    assert healthy.proc.poll() is None
    assert_invariants()
