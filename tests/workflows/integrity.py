"""Workflows for the evidence-integrity tests: a charge fed by an earlier step, a leaky provider."""

from __future__ import annotations

from django.db import connections

from k2b_workflows import Action, Effect, succeeded, workflow
from tests.workflows import Add, Charge
from tests.workflows.kernel import WaitSignal


@workflow("integrity.quote_then_charge", app_id="tests", effect_budget={"charges": 3})
def quote_then_charge(run, input):
    """Step 0 computes the amount, step 1 parks, step 2 charges what step 0 said."""
    quote = run.step(Add, {"a": input["amount"], "b": 0})
    run.step(WaitSignal, {"key": input["key"]})
    return run.step(Charge, {"amount": quote["sum"]})


@workflow("integrity.charge_then_wait", app_id="tests", effect_budget={"charges": 3})
def charge_then_wait(run, input):
    """Step 0 charges, step 1 parks: deleting step 0's evidence must not charge again."""
    charge = run.step(Charge, {"amount": input["amount"]})
    run.step(WaitSignal, {"key": input["key"]})
    return charge


class LeakyProvider(Action):
    """EXTERNAL: loses its lease while the provider answers with card data.

    The takeover commits on another connection before ``run()`` returns, as a
    second worker's claim would; the answer then arrives late.
    """

    name = "integrity.leaky_provider"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        with connections["default"].cursor() as cursor:
            cursor.execute(
                """UPDATE k2b_run SET generation = generation + 1,
                          lease_expires_at = now() - interval '1 second' WHERE id = %s""",
                [ctx.run_id],
            )
        return succeeded({"card_token": "tok_LIVE_51Hx", "pan": "4242424242424242"})


@workflow("integrity.late_card", app_id="tests")
def late_card(run, input):
    return run.step(LeakyProvider, {})


class Measure(Action):
    """PURE: a float of 1e16 or more, which ``jsonb`` gives back as an integer."""

    name = "integrity.measure"
    effect = Effect.PURE

    def run(self, ctx, input):
        return succeeded({"bytes": 2.5 * 10.0 ** input["power"], "ratio": 1.5e-7})


@workflow("integrity.measure_then_wait", app_id="tests")
def measure_then_wait(run, input):
    measured = run.step(Measure, {"power": input["power"]})
    run.step(WaitSignal, {"key": input["key"], "bytes": measured["bytes"]})
    return measured
