"""docs/waits.md, "Polling an EXTERNAL provider": a payout the bank settles later."""

import datetime as dt

from k2b_workflows import (
    Action,
    Dependency,
    Effect,
    ambiguous,
    failed,
    succeeded,
    unknown,
    waiting,
)

from .providers import bank


class Payout(Action):
    name = "shop.payout"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True, "settled": False}, summary=f"Pay {input['amount']}")

    # --8<-- [start:payout]
    def run(self, ctx, input):
        bank.submit_payout(reference=ctx.effect_key, amount=input["amount"])
        return ambiguous("accepted; settlement pending")

    def reconcile(self, ctx, input):
        state = bank.payout_status(reference=ctx.effect_key)
        if state == "pending":
            return waiting(Dependency("payout", ctx.effect_key, deadline=dt.timedelta(minutes=5)))
        if state == "settled":
            return succeeded({"settled": True})
        if state == "rejected":
            return failed("rejected by the bank", code="PAYOUT_REJECTED")
        return unknown(f"bank reports {state!r}")
    # --8<-- [end:payout]
