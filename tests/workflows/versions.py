"""Workflows for the versioning tests: two deploys of one workflow, and a patch.

Which code a process holds is chosen by environment variables, as two
deploys would differ: ``K2B_TEST_CODE`` lists the versions of
``ver.checkout`` this process registers ("v1", "v2", or "v1,v2", the
default); ``K2B_TEST_PATCH`` picks the code of ``ver.patched`` ("old" before
the patch, "new" with ``run.patched``, "deprecated" once the old branch is
gone), read when the workflow runs so in-process tests can switch it.
"""

from __future__ import annotations

import os

from k2b_workflows import Action, Effect, succeeded, workflow
from tests.models import ProviderCall
from tests.workflows import WaitFor, crash_point

CODE = {v.strip() for v in os.environ.get("K2B_TEST_CODE", "v1,v2").split(",")}
PATCH_ID = "ver.new-b"


class Stamp(Action):
    """PURE: records which code ran it, in which process."""

    name = "ver.stamp"
    effect = Effect.PURE

    def run(self, ctx, input):
        crash_point(input, "stamp")
        ProviderCall.objects.create(
            action=self.name,
            effect_key=ctx.effect_key,
            generation=ctx.generation,
            pid=os.getpid(),
            payload={"at": input["at"], "code": input.get("code"), "run": str(ctx.run_id)},
        )
        return succeeded({"at": input["at"], "code": input.get("code"), "pid": os.getpid()})


if "v1" in CODE:

    @workflow("ver.checkout", app_id="versions", version=1)
    def checkout_v1(run, input):
        run.step(Stamp, {"at": "start"})
        run.step(WaitFor, {"key": input["key"]})
        done = run.step(Stamp, {"at": "finish", "code": "v1"})
        return {"version": 1, "finished_on": done["code"], "pid": done["pid"]}


if "v2" in CODE:

    @workflow("ver.checkout", app_id="versions", version=2)
    def checkout_v2(run, input):
        # The first steps are those of version 1: only the end changed, as in a
        # small deploy that would replay an old run silently on the new code.
        run.step(Stamp, {"at": "start"})
        run.step(WaitFor, {"key": input["key"]})
        done = run.step(Stamp, {"at": "finish", "code": "v2"})
        return {"version": 2, "finished_on": done["code"], "pid": done["pid"]}


@workflow("ver.patched", app_id="versions")
def patched_workflow(run, input):
    code = os.environ.get("K2B_TEST_PATCH", "new")
    run.step(Stamp, {"at": "a"})
    run.step(WaitFor, {"key": input["k1"]})
    old_b = {"at": "old-b"}
    new_b = {"at": "new-b", "crash": input.get("crash")}
    if code == "old":
        run.step(Stamp, old_b)
        branch = "old"
    elif code == "new":
        if run.patched(PATCH_ID):
            run.step(Stamp, new_b)
            branch = "new"
        else:
            run.step(Stamp, old_b)
            branch = "old"
    else:  # "deprecated": every run with the old branch has ended
        run.deprecate_patch(PATCH_ID)
        run.step(Stamp, new_b)
        branch = "new"
    run.step(WaitFor, {"key": input["k2"]})
    return {"branch": branch}


@workflow("ver.buggy", app_id="versions")
def buggy_workflow(run, input):
    first = run.step(Stamp, {"at": "before-bug"})
    if os.environ.get("K2B_TEST_BUG_FIXED") != "1":
        first = {}  # the bug: the key is read from the wrong object
    return {"at": first["at"]}


@workflow("ver.reordered", app_id="versions")
def reordered_workflow(run, input):
    if os.environ.get("K2B_TEST_REORDERED") == "1":  # the wait moved before the first step
        run.step(WaitFor, {"key": input["key"]})
        run.step(Stamp, {"at": "a"})
    else:
        run.step(Stamp, {"at": "a"})
        run.step(WaitFor, {"key": input["key"]})
    run.step(Stamp, {"at": "b"})
    return {"done": True}


@workflow("ver.patched_at_wait", app_id="versions")
def patched_at_wait_workflow(run, input):
    """The patch replaces the very step an old run is parked in."""
    run.step(Stamp, {"at": "a"})
    if os.environ.get("K2B_TEST_PATCH") == "old" or not run.patched("ver.no-wait"):
        run.step(WaitFor, {"key": input["key"]})
        return {"branch": "old"}
    run.step(Stamp, {"at": "instead-of-wait"})
    return {"branch": "new"}
