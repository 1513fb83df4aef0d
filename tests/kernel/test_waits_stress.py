"""No lost wake: thousands of park/wake pairs raced across processes.

Two ``runworkflows`` processes park runs while two waker processes wake each
run as soon as it has been claimed, so a wake lands before the action reads,
between its read and its park, or after the park. A lost wake leaves a run
``waiting`` forever (no deadline), and the test times out naming it.

Which order a free race takes depends on the load of the machine (a loaded
one can make every wake find its run parked), so one run in ten is made to
take each of the two orders whatever the timing: its action holds between
its read and its park until the wake has committed, or its waker waits until
it has parked. The other runs race freely.
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
from tests.support.processes import ROOT
from tests.workflows.waits import WAKE_AFTER_PARK

PAIRS = 2000
WAKERS = 2
PREFIX = "race-"


def race_input(i: int) -> dict:
    key = f"{PREFIX}{i}"
    input = {"key": key, "quiet": True, "jitter_ms": 3}
    if i % 10 == 3:
        input["hold"] = key  # the wake commits between the action's read and its park
    elif i % 10 == 7:
        input["wake"] = WAKE_AFTER_PARK  # the wake finds the run parked
    return input


WAKER_CODE = (
    "import sys, django; django.setup();"
    " from tests.workflows.waits import waker_main; waker_main(sys.argv[1:])"
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
            start_workflow_run("waits.gate", race_input(i))
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
    assert counts["parked"] >= PAIRS // 10 and counts["unparked"] >= PAIRS // 10
    outputs_ok = {r.output["value"] for r in WorkflowRun.objects.filter(workflow_name="waits.gate")}
    assert outputs_ok == {f"{PREFIX}{i}" for i in range(PAIRS)}
