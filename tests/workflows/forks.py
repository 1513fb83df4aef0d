"""Actions and workflows of the fork tests (``tests/kernel/test_fork.py``).

Every action records its call as a ``ProviderCall`` (committed on its own), so
a test counts exactly which steps ran again in a fork. ``BROKEN`` is the bug a
deploy fixes: while it holds, ``Brittle`` fails.
"""

from __future__ import annotations

import os

from k2b_workflows import Action, Effect, StepFailed, failed, succeeded, workflow
from tests.models import ProviderCall

APP = "forks"

#: The bug of today's code: ``Brittle`` fails while this is True.
BROKEN = {"on": True}


def _record(action: str, ctx, **payload) -> None:
    ProviderCall.objects.create(
        action=action,
        effect_key=ctx.effect_key,
        invocation_key=ctx.invocation_key or "",
        generation=ctx.generation,
        pid=os.getpid(),
        payload=payload or None,
    )


class Note(Action):
    """PURE: returns its input."""

    name = "forks.note"
    effect = Effect.PURE

    def run(self, ctx, input):
        _record(self.name, ctx, n=input["n"])
        return succeeded({"n": input["n"]})


class Send(Action):
    """IDEMPOTENT: the provider deduplicates by ``effect_key``."""

    name = "forks.send"
    effect = Effect.IDEMPOTENT

    def run(self, ctx, input):
        _record(self.name, ctx, to=input["to"])
        return succeeded({"key": ctx.effect_key})


class Pay(Action):
    """EXTERNAL, no reconcile: "raise" leaves the outcome unknown, "decline" fails."""

    name = "forks.pay"
    effect = Effect.EXTERNAL

    def run(self, ctx, input):
        _record(self.name, ctx, amount=input["amount"])
        if input.get("behaviour") == "raise":
            raise ConnectionError("the provider's answer was lost")
        if input.get("behaviour") == "decline":
            return failed("card declined", code="CARD_DECLINED")
        return succeeded({"paid": input["amount"]})


class Brittle(Action):
    """PURE: fails (not retryable) while ``BROKEN`` holds."""

    name = "forks.brittle"
    effect = Effect.PURE

    def run(self, ctx, input):
        _record(self.name, ctx, n=input.get("n"))
        if BROKEN["on"]:
            return failed("today's bug", code="BROKEN")
        return succeeded({"fixed": True})


@workflow("forks.line", app_id=APP)
def line(run, input):
    """note (0), send (1), [pay (2)], brittle (last)."""
    run.step(Note, {"n": 0})
    sent = run.step(Send, {"to": input["to"]})
    if input.get("pay"):
        run.step(Pay, {"amount": 5, "behaviour": input.get("behaviour", "")})
    run.step(Brittle, {})
    return {"sent": sent["key"]}


@workflow("forks.catching", app_id=APP)
def catching(run, input):
    """A failure caught at step 0, then a failure at step 2 that ends the run."""
    try:
        run.step(Brittle, {"n": 0})
        first = "succeeded"
    except StepFailed:
        first = "failed"
    run.step(Note, {"n": 1})
    run.step(Brittle, {"n": 2})
    return {"first": first}


@workflow("forks.kid", app_id=APP)
def kid(run, input):
    return run.step(Note, {"n": input["n"]})


@workflow("forks.paying_kid", app_id=APP)
def paying_kid(run, input):
    return run.step(Pay, {"amount": input["n"]})


@workflow("forks.parent", app_id=APP)
def parent(run, input):
    """children (0), brittle (1)."""
    kids = run.children(input.get("kid", "forks.kid"), [{"n": 1}, {"n": 2}])
    run.step(Brittle, {})
    return {"kids": [k.output for k in kids]}
