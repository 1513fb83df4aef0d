"""Workflows for the fence tests: each stops at a gate just before one write path.

A gate is a pair of events keyed by name (the run's input names it): the
executing thread sets ``reached`` and waits for ``go``; the test takes the run
over (or reaps it) in between. Ordering is by events and database locks, never
by sleeping. A gate nobody registered is open, so later executions pass.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from django.db import transaction

from k2b_workflows import Action, Dependency, Effect, succeeded, waiting, workflow
from tests.models import DomainRow, ProviderCall

GATE_TIMEOUT_S = 60


@dataclass
class Gate:
    reached: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)


GATES: dict[str, Gate] = {}


def gate(name: str) -> None:
    """Stop here until the test says go (once: a gate opens for good)."""
    current = GATES.get(name)
    if current is None or current.go.is_set():
        return
    current.reached.set()
    if not current.go.wait(GATE_TIMEOUT_S):
        raise RuntimeError(f"gate {name} was never opened")


def _row(ctx, input, using: str = "default") -> None:
    DomainRow.objects.using(using).create(
        key=f"{input['gate']}:{ctx.generation}", value=input.get("path"), generation=ctx.generation
    )


class TxWrite(Action):
    """TRANSACTIONAL: writes in ``ctx.tx``; gated inside when the input asks (row lock held)."""

    name = "fence.tx_write"
    effect = Effect.TRANSACTIONAL

    def run(self, ctx, input):
        _row(ctx, input, ctx.tx.using)
        if input.get("gate_inside"):
            gate(input["gate"])
        return succeeded({"written": True})


class FencedWrite(Action):
    """IDEMPOTENT: stores its result in ``ctx.fenced()``; gated inside when the input asks."""

    name = "fence.fenced_write"
    effect = Effect.IDEMPOTENT

    def run(self, ctx, input):
        with ctx.fenced():
            _row(ctx, input)
            if input.get("gate_inside"):
                gate(input["gate"])
        return succeeded({"written": True})


class HeartbeatTxWrite(Action):
    """IDEMPOTENT: its own atomic block, made safe by ``ctx.heartbeat(tx)`` before commit."""

    name = "fence.heartbeat_tx_write"
    effect = Effect.IDEMPOTENT

    def run(self, ctx, input):
        with transaction.atomic(using="default"):
            _row(ctx, input)
            ctx.heartbeat(tx="default")
        return succeeded({"written": True})


class HeartbeatThenWrite(Action):
    """IDEMPOTENT: renews the lease (no tx) after the gate, and writes only if it still owns it."""

    name = "fence.heartbeat_then_write"
    effect = Effect.IDEMPOTENT

    def run(self, ctx, input):
        gate(input["gate"])
        ctx.heartbeat()
        _row(ctx, input)
        return succeeded({"written": True})


class GatedPure(Action):
    """PURE: computes past the gate; only the kernel's journal write could commit anything."""

    name = "fence.gated_pure"
    effect = Effect.PURE

    def run(self, ctx, input):
        if input.get("gate_inside"):
            gate(input["gate"])
        return succeeded({"computed": True})


class Costly(Action):
    """IDEMPOTENT with a cost: the charge commits before ``run()``."""

    name = "fence.costly"
    effect = Effect.IDEMPOTENT

    def cost(self, input):
        return {"units": 1}

    def run(self, ctx, input):
        _row(ctx, input)
        return succeeded({"charged": True})


class ExternalCall(Action):
    """EXTERNAL: the provider call is a ``ProviderCall`` row; gated after it when asked."""

    name = "fence.external_call"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        ProviderCall.objects.create(
            action=self.name,
            effect_key=ctx.effect_key,
            invocation_key=ctx.invocation_key or "",
            generation=ctx.generation,
        )
        if input.get("gate_inside"):
            gate(input["gate"])
        return succeeded({"secret_token": "tok_LIVE_123", "ok": True})


class Wait(Action):
    """PURE that parks the run on a key nobody wakes."""

    name = "fence.wait"
    effect = Effect.PURE

    def run(self, ctx, input):
        return waiting(Dependency("fence", input["gate"]))


def _gated_step(action: type[Action]):
    def fn(run, input):
        if not input.get("gate_inside"):
            gate(input["gate"])
        return run.step(action, input)

    return fn


workflow("fence.tx", app_id="fence")(_gated_step(TxWrite))
workflow("fence.fenced", app_id="fence")(_gated_step(FencedWrite))
workflow("fence.heartbeat_tx", app_id="fence")(_gated_step(HeartbeatTxWrite))
workflow("fence.journal", app_id="fence")(_gated_step(GatedPure))
workflow("fence.dispatch", app_id="fence")(_gated_step(ExternalCall))
workflow("fence.park", app_id="fence")(_gated_step(Wait))
workflow("fence.charge", app_id="fence", effect_budget={"units": 5})(_gated_step(Costly))


@workflow("fence.heartbeat", app_id="fence")
def heartbeat_workflow(run, input):
    return run.step(HeartbeatThenWrite, input)


@workflow("fence.finish", app_id="fence")
def finish_workflow(run, input):
    run.step(GatedPure, {})
    gate(input["gate"])
    return {"finished": True}


@workflow("fence.finish_journaled", app_id="fence")
def finish_journaled_workflow(run, input):
    """The last step commits its own journal entry: the end is a statement of its own."""
    run.step(TxWrite, {"gate": input["gate"], "path": "ctx.tx"})
    gate(input["gate"])
    return {"finished": True}
