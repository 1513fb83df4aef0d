"""An EXTERNAL payout whose provider answers "pending" and is polled until it settles."""

from __future__ import annotations

import datetime as dt

from k2b_workflows import Action, Dependency, Effect, ambiguous, succeeded, waiting
from tests.models import ProviderCall
from tests.support.workflow_steps import one_step


class Payout(Action):
    """The provider accepts the payout at once and settles it after ``polls`` lookups."""

    name = "test.payout"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action="payout.submit",
            effect_key=ctx.effect_key,
            invocation_key=ctx.invocation_key,
            generation=ctx.generation,
        )
        return ambiguous("accepted; settlement pending")

    def reconcile(self, ctx, input):
        ProviderCall.objects.create(
            action="payout.poll",
            effect_key=ctx.effect_key,
            invocation_key=ctx.invocation_key,
            generation=ctx.generation,
        )
        polls = ProviderCall.objects.filter(action="payout.poll", effect_key=ctx.effect_key)
        if polls.count() < input["polls"]:
            return waiting(
                Dependency(
                    "payout",
                    ctx.effect_key,
                    deadline=dt.timedelta(milliseconds=input.get("every_ms", 50)),
                )
            )
        return succeeded({"settled": True, "polls": polls.count()})


one_step("test.payout", Payout)
