"""Workflows with concurrency keys, rate-limited actions and priorities (the flow tests)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

from k2b_workflows import Action, Concurrency, Effect, RateLimit, failed, succeeded, workflow
from tests.models import ProviderCall


class Span(Action):
    """PURE: commits a row as it starts and one as it ends, sleeping in between.

    Each row is its own transaction (autocommit), so the rows say when the action
    really ran, whatever happens to the run afterwards: overlap per key is
    measured from them, not from the kernel's own records.
    """

    name = "flow.span"
    effect = Effect.PURE

    def run(self, ctx, input):
        fields = {"action": self.name, "effect_key": ctx.effect_key, "pid": os.getpid()}
        key = input["key"]
        ProviderCall.objects.create(
            **fields, generation=ctx.generation, payload={"key": key, "edge": "start"}
        )
        time.sleep(float(input.get("nap", 0.2)))
        ProviderCall.objects.create(
            **fields, generation=ctx.generation, payload={"key": key, "edge": "end"}
        )
        if input.get("raise"):
            raise RuntimeError("told to raise")
        if input.get("fail"):
            return failed("told to fail", code="TOLD_TO_FAIL")
        return succeeded({"key": key})


@workflow("flow.keyed", app_id="tests", concurrency=Concurrency(limit=2))
def keyed(run, input):
    run.step(Span, input)
    return {"key": input["key"]}


@workflow("flow.one_at_a_time", app_id="tests", concurrency=Concurrency(limit=1))
def one_at_a_time(run, input):
    run.step(Span, input)
    return {"key": input["key"]}


@workflow(
    "flow.latest_wins",
    app_id="tests",
    concurrency=Concurrency(limit=1, strategy="cancel_in_progress"),
)
def latest_wins(run, input):
    run.step(Span, input)
    return {}


@workflow(
    "flow.first_wins", app_id="tests", concurrency=Concurrency(limit=1, strategy="cancel_newest")
)
def first_wins(run, input):
    run.step(Span, input)
    return {}


class Rated(Action):
    """IDEMPOTENT, at most 5 dispatches a second across every worker; one budget unit a call.

    The provider's own timestamp (``time.time()`` as ``run()`` begins) is what the
    test checks the limit against.
    """

    name = "flow.rated"
    effect = Effect.IDEMPOTENT
    rate_limit = RateLimit(5, per=timedelta(seconds=1))

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def cost(self, input):
        return {"calls": 1}

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name,
            effect_key=ctx.effect_key,
            generation=ctx.generation,
            pid=os.getpid(),
            payload={"t": time.time()},
        )
        return succeeded({"sent": True})


class RatedPerKey(Rated):
    name = "flow.rated_per_key"
    rate_limit = RateLimit(1, per=timedelta(hours=1))

    def rate_limit_key(self, input):
        return input["api_key"]


@workflow("flow.rated", app_id="tests", effect_budget={"calls": 1})
def rated(run, input):
    run.step(Rated, input)
    return {}


@workflow("flow.rated_per_key", app_id="tests")
def rated_per_key(run, input):
    run.step(RatedPerKey, input)
    return {}


class Stamp(Action):
    """PURE: records when it ran, for the order of claims."""

    name = "flow.stamp"
    effect = Effect.PURE

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name,
            effect_key=ctx.effect_key,
            pid=os.getpid(),
            payload={"label": input.get("label"), "t": time.time()},
        )
        time.sleep(float(input.get("nap", 0)))
        return succeeded({})


@workflow("flow.stamp", app_id="tests")
def stamp(run, input):
    run.step(Stamp, input)
    return {}


@workflow("flow.blind", app_id="tests", concurrency=Concurrency(limit=1))
def blind(run, input):
    """An EXTERNAL step whose first answer is lost: the run needs an operator."""
    from tests.workflows.kernel import BlindOnce

    return run.step(BlindOnce, {})


@workflow(
    "flow.one_at_a_time_timed",
    app_id="tests",
    concurrency=Concurrency(limit=1),
    timeout=timedelta(seconds=8),
)
def one_at_a_time_timed(run, input):
    """Canceled by its timeout while its action sleeps inside ``run()`` (#35)."""
    run.step(Span, input)
    return {"key": input["key"]}


@workflow(
    "flow.latest_wins_blind",
    app_id="tests",
    concurrency=Concurrency(limit=1, strategy="cancel_in_progress"),
)
def latest_wins_blind(run, input):
    """An EXTERNAL step whose first answer is lost, under ``cancel_in_progress`` (#35)."""
    from tests.workflows.kernel import BlindOnce

    return run.step(BlindOnce, {})


class RatedTwiceAnHour(Rated):
    name = "flow.rated_twice_an_hour"
    rate_limit = RateLimit(2, per=timedelta(hours=1))


@workflow("flow.rated_twice_an_hour", app_id="tests")
def rated_twice_an_hour(run, input):
    run.step(RatedTwiceAnHour, input)
    return {}
