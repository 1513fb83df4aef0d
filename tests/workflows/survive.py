"""A workflow touching every effect class, for tests that restart the database under workers."""

from __future__ import annotations

import time

from k2b_workflows import Action, Effect, succeeded, workflow
from tests.workflows import Add, Charge, SendIdempotent, WriteRow


class Nap(Action):
    """PURE: keeps a worker thread busy for a moment, so restarts land inside steps."""

    name = "survive.nap"
    effect = Effect.PURE

    def run(self, ctx, input):
        time.sleep(float(input.get("seconds", 0.1)))
        return succeeded({"napped": True})


@workflow("survive.mixed", app_id="tests", effect_budget={"charges": 2, "emails": 5})
def mixed_workflow(run, input):
    key = input["key"]
    total = run.step(Add, {"a": input.get("n", 0), "b": 1})
    run.step(Nap, {"seconds": input.get("nap", 0.1)})
    run.step(WriteRow, {"key": f"tx:{key}", "value": total["sum"]})
    run.step(SendIdempotent, {"to": f"{key}@example.com"})
    run.step(Nap, {"seconds": input.get("nap", 0.1)})
    charge = run.step(Charge, {"amount": total["sum"]})
    return {"charge": charge["charge_id"]}
