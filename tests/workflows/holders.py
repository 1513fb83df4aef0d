"""Workflows for the live-holder tests (#47): an EXTERNAL call that takes its time.

The provider sees a charge only when the call completes (the row committed at
the end of ``run()``), as a real provider's lookup lags behind a request in
flight: asked in between, ``reconcile()`` answers "absent". Each reconcile
leaves a row, so a test can tell whether one was asked at all.
"""

from __future__ import annotations

import os
import time

from k2b_workflows import Action, Effect, create_child_workflow_runs, failed, succeeded, workflow
from tests.models import ProviderCall

from .fence import gate

#: The provider's record of a charge, whichever action made it.
CHARGE = "holders.slow_charge"


class SlowCharge(Action):
    """EXTERNAL: says it started, waits (``seconds``, or a test's gate), then charges."""

    name = "holders.slow_charge"
    effect = Effect.EXTERNAL

    def run(self, ctx, input):
        fields = {"effect_key": ctx.effect_key, "generation": ctx.generation, "pid": os.getpid()}
        ProviderCall.objects.create(action="holders.started", **fields)
        if input.get("gate"):
            gate(input["gate"])
        if input.get("until_released"):  # the test says when the provider answers
            released = {"action": "holders.release", "effect_key": ctx.effect_key}
            deadline = time.monotonic() + 120
            while not ProviderCall.objects.filter(**released).exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("never released")
                time.sleep(0.05)
        deadline = time.monotonic() + float(input.get("seconds", 0))
        while time.monotonic() < deadline:  # slices: a SIGSTOP lands in one of them
            time.sleep(0.05)
        call = ProviderCall.objects.create(action=CHARGE, **fields)
        return succeeded({"charge_id": f"ch_{call.pk}"})

    def reconcile(self, ctx, input):
        found = ProviderCall.objects.filter(action=CHARGE, effect_key=ctx.effect_key).first()
        if input.get("lookup_lags"):  # the provider's lookup has not caught up with it yet
            found = None
        ProviderCall.objects.create(
            action="holders.reconcile",
            effect_key=ctx.effect_key,
            generation=ctx.generation,
            payload={"found": found is not None},
        )
        if found is None:
            return failed("no charge with this key", retryable=True)
        return succeeded({"charge_id": f"ch_{found.pk}", "reconciled": True})


class SlowChargeByKey(SlowCharge):
    """The provider deduplicates by the effect key: "absent" dispatches again under it."""

    name = "holders.slow_charge_by_key"
    redispatch_when_absent = True


@workflow("holders.charge", app_id="tests")
def charge(run, input):
    return run.step(SlowCharge, input)


@workflow("holders.charge_by_key", app_id="tests")
def charge_by_key(run, input):
    return run.step(SlowChargeByKey, input)


# -- a running run asked to stop (#49) ------------------------------------------


class Ship(Action):
    """PURE: the step after the charge; says it ran (it never should once asked)."""

    name = "holders.ship"
    effect = Effect.PURE

    def run(self, ctx, input):
        ProviderCall.objects.create(action="holders.shipped", effect_key=ctx.effect_key)
        return succeeded({"shipped": True})


class Held(Action):
    """PURE: says it started, then returns once the test releases it (``holders.release``
    with its effect key), or once ``ctx.canceled`` is set when the input says so."""

    name = "holders.held"
    effect = Effect.PURE

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action="holders.started", effect_key=ctx.effect_key, pid=os.getpid()
        )
        released = {"action": "holders.release", "effect_key": ctx.effect_key}
        deadline = time.monotonic() + 120
        while not ProviderCall.objects.filter(**released).exists():
            if input.get("until_canceled") and ctx.canceled.is_set():
                ProviderCall.objects.create(
                    action="holders.saw_cancel",
                    effect_key=ctx.effect_key,
                    payload={"at": time.time()},
                )
                break
            if time.monotonic() > deadline:
                raise RuntimeError("never released")
            time.sleep(0.02)
        return succeeded({"held": ctx.effect_key})


@workflow("holders.charge_then_ship", app_id="tests")
def charge_then_ship(run, input):
    charge = run.step(SlowCharge, input)
    run.step(Ship, {})
    return charge


@workflow("holders.held_then_ship", app_id="tests")
def held_then_ship(run, input):
    held = run.step(Held, input)
    run.step(Ship, {})
    return held


@workflow("holders.parent_then_ship", app_id="tests")
def parent_then_ship(run, input):
    create_child_workflow_runs(run, "holders.held_then_ship", [{}])
    held = run.step(Held, input)
    run.step(Ship, {})
    return held


class HeldCharge(Held):
    """EXTERNAL with no ``reconcile``: an outcome a crash leaves unknown is an operator's."""

    name = "holders.held_charge"
    effect = Effect.EXTERNAL


@workflow("holders.held_charge_then_ship", app_id="tests")
def held_charge_then_ship(run, input):
    charge = run.step(HeldCharge, input)
    run.step(Ship, {})
    return charge
