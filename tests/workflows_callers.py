"""Actions and workflows for retry policies, durable timers, workflow timeouts and async hooks.

Each action records its calls as ``ProviderCall`` rows (committed on their
own, like a provider's log), so a test counts attempts after crashes too.
"""

from __future__ import annotations

import datetime as dt
import os

from k2b_workflows import Action, Effect, Retry, failed, succeeded, workflow

from .models import ProviderCall
from .workflow_helpers import one_step


def calls(name: str) -> int:
    return ProviderCall.objects.filter(action=name).count()


class FlakyUntil(Action):
    """Fails (retryable, code ``input["code"]``) until called ``input["ok_at"]`` times."""

    name = "callers.flaky"
    effect = Effect.PURE

    def run(self, ctx, input):
        ProviderCall.objects.create(action=self.name, effect_key=ctx.effect_key)
        if calls(self.name) < input["ok_at"]:
            return failed("not yet", code=input.get("code"), retryable=True)
        return succeeded({"calls": calls(self.name)})


class PatientFlaky(FlakyUntil):
    """The same, under a policy of its own: eight attempts, an hour apart at first."""

    name = "callers.patient"
    retry = Retry(max_attempts=8, backoff=dt.timedelta(hours=1), max_backoff=dt.timedelta(hours=4))


class OneShot(FlakyUntil):
    """Never retried: a step that must give up after its first failure."""

    name = "callers.one_shot"
    retry = Retry(max_attempts=1)


class Declines(FlakyUntil):
    """A retryable failure whose code the policy says is final."""

    name = "callers.declines"
    retry = Retry(max_attempts=5, backoff=0.001, non_retryable_codes=("CARD_DECLINED",))


class Raises(Action):
    """Raises every time: an exception is retryable, under the workflow's policy."""

    name = "callers.raises"
    effect = Effect.PURE

    def run(self, ctx, input):
        ProviderCall.objects.create(action=self.name, effect_key=ctx.effect_key)
        raise RuntimeError("provider down")


one_step("callers.flaky", FlakyUntil)
one_step("callers.patient", PatientFlaky)
one_step("callers.one_shot", OneShot)
one_step("callers.declines", Declines)


@workflow(
    "callers.raises_twice", app_id="tests", retry=Retry(max_attempts=2, backoff=0.001, jitter=False)
)
def raises_twice(run, input):
    return run.step(Raises, {})


@workflow(
    "callers.workflow_policy",
    app_id="tests",
    retry=Retry(max_attempts=9, backoff=dt.timedelta(minutes=10)),
)
def workflow_policy(run, input):
    # FlakyUntil has no policy: the workflow's applies; OneShot's own wins over it.
    first = run.step(FlakyUntil, {"ok_at": input["ok_at"]})
    return {"first": first, "second": run.step(OneShot, {"ok_at": 0})}


class Record(Action):
    """Notes that the workflow reached ``input["tag"]`` (one row per call)."""

    name = "callers.record"
    effect = Effect.PURE

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name, effect_key=ctx.effect_key, payload=input["tag"], pid=os.getpid()
        )
        return succeeded({"tag": input["tag"]})


def recorded(tag: str) -> int:
    return ProviderCall.objects.filter(action=Record.name, payload=tag).count()


@workflow("callers.sleeper", app_id="tests")
def sleeper(run, input):
    run.step(Record, {"tag": "before"})
    if "until" in input:
        run.sleep_until(dt.datetime.fromisoformat(input["until"]))
    else:
        run.sleep(dt.timedelta(seconds=input["seconds"]))
    if "flaky_at" in input:
        run.step(FlakyUntil, {"ok_at": input["flaky_at"]})
    run.step(Record, {"tag": "after"})
    return {"slept": True}


@workflow("callers.bad_sleep", app_id="tests")
def bad_sleep(run, input):
    if input["kind"] == "naive":
        run.sleep_until(dt.datetime(2030, 1, 1))
    elif input["kind"] == "zero":
        run.sleep(dt.timedelta(0))
    else:
        run.sleep(5)
    return {}


class BlocksUntilCanceled(Action):
    """An external effect whose provider answers only once the run is canceled (late)."""

    name = "callers.blocks"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name, effect_key=ctx.effect_key, generation=ctx.generation
        )
        ctx.canceled.wait(input.get("block_s", 60))
        return succeeded({"late": True})


class ChargeOnce(Action):
    """An external effect without reconcile(): after a crash, an operator decides."""

    name = "callers.charge_once"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        ProviderCall.objects.create(action=self.name, effect_key=ctx.effect_key)
        return succeeded({"charged": True})


@workflow("callers.timed_gate", app_id="tests", timeout=dt.timedelta(hours=1))
def timed_gate(run, input):
    from .workflows_waits import Gate

    return run.step(Gate, {"key": input["key"]})


@workflow("callers.timed_external", app_id="tests", timeout=dt.timedelta(hours=1))
def timed_external(run, input):
    run.step(Record, {"tag": "before"})
    return run.step(BlocksUntilCanceled, {})


@workflow("callers.timed_charge", app_id="tests", timeout=dt.timedelta(hours=1))
def timed_charge(run, input):
    return run.step(ChargeOnce, {})
