"""Actions and workflows for the unit tests of the kernel's layers (``RunJournal``,
``RunEnding``): runs to claim, and steps whose effect class the journal reads.

The workflows are claimed but never executed by these tests: they build each
step by hand, the way ``Execution`` does, and call one layer at a time.
"""

from __future__ import annotations

from k2b_workflows import Action, Effect, succeeded, workflow


class UnitPure(Action):
    name = "units.pure"
    effect = Effect.PURE

    def run(self, ctx, input):
        return succeeded({"n": input.get("n", 0) + 1})


class UnitExternal(Action):
    name = "units.external"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        return succeeded({"sent": True})

    reconcile = run


@workflow("units.plain", app_id="tests")
def plain_workflow(run, input):
    return run.step(UnitPure, input)


@workflow("units.budgeted", app_id="tests", effect_budget={"emails": 3})
def budgeted_workflow(run, input):
    return run.step(UnitPure, input)
