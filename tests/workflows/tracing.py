"""A workflow for the tracing tests: three steps, the second may kill its worker.

Inputs and outputs carry marker strings (``IN-SECRET``, ``OUT-SECRET``) that
must never appear in an exported span.
"""

from __future__ import annotations

from k2b_workflows import Action, Effect, succeeded, waiting, workflow
from k2b_workflows.actions import Dependency
from tests.models import DomainRow, ProviderCall
from tests.workflows import crash_point


class Prepare(Action):
    name = "tracing.prepare"
    effect = Effect.PURE

    def run(self, ctx, input):
        return succeeded({"token": "OUT-SECRET-" + input["marker"]})


class Send(Action):
    """IDEMPOTENT: records its effect key, then may kill the process (``K2B_TEST_CRASH``)."""

    name = "tracing.send"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name, effect_key=ctx.effect_key, generation=ctx.generation
        )
        crash_point(input, "tracing_send")
        return succeeded({"receipt": "OUT-SECRET-receipt"})


class Gate(Action):
    """Waits until a DomainRow with the key exists."""

    name = "tracing.gate"
    effect = Effect.PURE

    def run(self, ctx, input):
        if not DomainRow.objects.filter(key=input["key"]).exists():
            return waiting(Dependency("gate", input["key"]))
        return succeeded({"opened": True})


@workflow("tracing.three_steps", app_id="tests")
def three_steps(run, input):
    prepared = run.step(Prepare, {"marker": input["marker"]})
    sent = run.step(Send, {"token": prepared["token"], "crash": input.get("crash")})
    if input.get("gate"):
        run.step(Gate, {"key": input["gate"]})
    return {"receipt": sent["receipt"], "marker": "OUT-SECRET-" + input["marker"]}
