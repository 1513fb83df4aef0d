"""No lost wake: thousands of park/wake pairs raced across processes.

Two ``runworkflows`` processes park runs while two waker processes wake each
run as soon as it has been claimed, so a wake lands before the action reads,
between its read and its park, or after the park. A lost wake leaves a run
``waiting`` forever (no deadline), and the test times out naming it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from django.db import connection

from k2b_workflows import start_workflow_run
from k2b_workflows.models import WorkflowRun

from .conftest import ROOT

PAIRS = 2000
WAKERS = 2
PREFIX = "race-"

WAKER_CODE = (
    "import sys, django; django.setup();"
    " from tests.workflows_waits import waker_main; waker_main(sys.argv[1:])"
)


def start_waker(share: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "K2B_TEST_DB_NAME": connection.settings_dict["NAME"],
    }
    return subprocess.Popen(
        [sys.executable, "-c", WAKER_CODE, PREFIX, str(PAIRS), str(share), str(WAKERS)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_no_wake_is_lost_when_thousands_of_parks_and_wakes_race(start_worker, wait):
    from django.db import transaction

    with transaction.atomic():
        for i in range(PAIRS):
            start_workflow_run("waits.gate", {"key": f"{PREFIX}{i}", "quiet": True, "jitter_ms": 3})
    wakers = [start_waker(share) for share in range(WAKERS)]
    workers = [start_worker("--concurrency", "4") for _ in range(2)]
    try:
        outputs = [w.communicate(timeout=240)[0] for w in wakers]
        assert all(w.returncode == 0 for w in wakers), outputs

        def unfinished() -> list[str]:
            return list(
                WorkflowRun.objects.filter(workflow_name="waits.gate")
                .exclude(status="succeeded")
                .values_list("status", flat=True)[:5]
            )

        wait(
            lambda: not unfinished(),
            timeout=120,
            message=f"every raced run to succeed (some still {unfinished()})",
        )
    finally:
        for w in wakers:
            if w.poll() is None:
                w.kill()
    for worker in workers:
        worker.signal(signal.SIGTERM)
        worker.wait(timeout=30)

    counts = {"parked": 0, "unparked": 0, "left": 0}
    for out in outputs:
        for name, value in re.findall(r"(\w+)=(\d+)", out):
            counts[name] += int(value)
    rewoken = sum(int(m) for w in workers for m in re.findall(r"'rewoken': (\d+)", w.output()))
    sys.stdout.write(f"\nraced {PAIRS} pairs: {counts}, parks that found a wake first: {rewoken}\n")
    assert counts["left"] == 0
    assert counts["parked"] + counts["unparked"] == PAIRS
    # Both orders happened: wakes that found the run parked, and wakes that did not.
    assert counts["parked"] > 0 and counts["unparked"] > 0
    outputs_ok = {r.output["value"] for r in WorkflowRun.objects.filter(workflow_name="waits.gate")}
    assert outputs_ok == {f"{PREFIX}{i}" for i in range(PAIRS)}
