"""Workflows the schedule tests fire: one that ends at once, one that waits, one that naps.

None declares ``schedule=``: the suite's registry is migrated into every test
database, and a decorator schedule there would fire in every other test.
"""

from __future__ import annotations

import time

from k2b_workflows import (
    Action,
    Dependency,
    Effect,
    succeeded,
    waiting,
    wake_workflow_runs_waiting_on,
    workflow,
)
from tests.models import DomainRow


@workflow("sched.echo", app_id="sched")
def echo(run, input):
    return {"scheduled_for": input["scheduled_for"]}


class WaitForRelease(Action):
    """Parks the run until ``release(scheduled_for)``: a run that has not ended."""

    name = "sched.wait_for_release"
    effect = Effect.PURE

    def run(self, ctx, input):
        if DomainRow.objects.filter(key=f"release:{input['scheduled_for']}").exists():
            return succeeded({})
        return waiting(Dependency("release", input["scheduled_for"]))


def release(scheduled_for: str) -> None:
    """Let the waiting run of the tick ``scheduled_for`` end."""
    DomainRow.objects.create(key=f"release:{scheduled_for}")
    wake_workflow_runs_waiting_on(app_id="sched", kind="release", key=scheduled_for)


@workflow("sched.waits", app_id="sched")
def waits(run, input):
    run.step(WaitForRelease, {"scheduled_for": input["scheduled_for"]})
    return {"scheduled_for": input["scheduled_for"]}


class Nap(Action):
    """Sleeps ``input["nap"]`` real seconds: a slow run, for overlap across real workers."""

    name = "sched.nap"
    effect = Effect.PURE

    def run(self, ctx, input):
        time.sleep(float(input.get("nap", 0)))
        return succeeded({})


@workflow("sched.slow", app_id="sched")
def slow(run, input):
    run.step(Nap, {"nap": input.get("nap", 0)})
    return {"scheduled_for": input["scheduled_for"]}
