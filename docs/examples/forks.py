"""docs/operators.md, "Fork from a step": go on from the step that failed, after the fix."""

from k2b_workflows import (
    Action,
    Effect,
    ForkRefused,
    failed,
    fork_workflow_run,
    succeeded,
    workflow,
)

#: The bug a deploy fixes: the parser refuses dates with a time zone until then.
PARSER = {"fixed": False}
#: The files the provider served, by effect key.
FETCHED: list[str] = []


class Fetch(Action):
    name = "imports.fetch"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True}, summary=f"Fetch {input['url']}")

    def run(self, ctx, input):
        FETCHED.append(ctx.effect_key)
        return succeeded({"rows": ["2026-12-06T01:00:00+01:00"]})


class Parse(Action):
    name = "imports.parse"
    effect = Effect.PURE

    def run(self, ctx, input):
        if not PARSER["fixed"]:
            return failed("cannot parse a date with a time zone", code="PARSE_ERROR")
        return succeeded({"parsed": len(input["rows"])})


@workflow("imports.load", app_id="imports")
def load(run, input):
    fetched = run.step(Fetch, {"url": input["url"]})
    return run.step(Parse, {"rows": fetched["rows"]})


# --8<-- [start:fork]
def fork_after_the_fix(run_id, operator):
    """Go on from the step that failed, on the code deployed now."""
    try:
        return fork_workflow_run(
            run_id, from_step="failure", actor=operator, reason="the date parser is fixed"
        )
    except ForkRefused as refused:
        # A step after the failure had an external effect that may have happened:
        # check with the provider, then fork again naming it in repeat_effects=[...].
        print([(step["seq"], step["action"], step["state"]) for step in refused.steps])
        raise


# --8<-- [end:fork]
