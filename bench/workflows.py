"""The benchmark's actions and workflows: one per effect class, a mix, a fan-out, a waiter.

Actions do as little as possible so that what is measured is the kernel:
its commits, claims and replays. Tables ``bench_gate``, ``bench_sample`` and
``bench_row`` are created by ``bench/run.py`` (this app has no migrations).
"""

from __future__ import annotations

import time

from django.db import connection, connections

from k2b_workflows import Action, Dependency, Effect, succeeded, waiting, workflow


class WaitForGate(Action):
    """Records when it starts (``time.time()``), then waits until its gate row exists."""

    name = "bench.wait_for_gate"
    effect = Effect.PURE

    def run(self, ctx, input):
        started = time.time()
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM bench_gate WHERE key = %s", [input["key"]])
            if cursor.fetchone() is None:
                return waiting(Dependency("gate", input["key"]))
            cursor.execute(
                "INSERT INTO bench_sample (key, started) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                [input["key"], started],
            )
        return succeeded({"started": started})


class Pure(Action):
    name = "bench.pure"
    effect = Effect.PURE

    def run(self, ctx, input):
        return succeeded({"n": input["n"] + 1})


class Transactional(Action):
    """Writes one domain row in the kernel's transaction (``ctx.tx``)."""

    name = "bench.transactional"
    effect = Effect.TRANSACTIONAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        with connections[ctx.tx.using].cursor() as cursor:
            cursor.execute("INSERT INTO bench_row (effect_key) VALUES (%s)", [ctx.effect_key])
        return succeeded({"n": input["n"] + 1})


class Idempotent(Action):
    """A provider that deduplicates by ``effect_key`` (simulated: nothing to call)."""

    name = "bench.idempotent"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        return succeeded({"n": input["n"] + 1, "id": ctx.effect_key})


class External(Action):
    """An external effect with a lookup (simulated provider: always answers at once)."""

    name = "bench.external"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        return succeeded({"n": input["n"] + 1, "id": ctx.invocation_key})

    def reconcile(self, ctx, input):
        return succeeded({"n": input["n"] + 1, "id": ctx.invocation_key})


ACTIONS = {
    "PURE": Pure,
    "TRANSACTIONAL": Transactional,
    "IDEMPOTENT": Idempotent,
    "EXTERNAL": External,
}


@workflow("bench.wait", app_id="bench")
def wait_workflow(run, input):
    return run.step(WaitForGate, input)


def _steps(action):
    def body(run, input):
        n = 0
        for _ in range(input["steps"]):
            n = run.step(action, {"n": n})["n"]
        return {"n": n}

    return body


for _effect, _action in ACTIONS.items():
    workflow(f"bench.steps.{_effect.lower()}", app_id="bench", max_steps=10_000)(_steps(_action))


@workflow("bench.steps.mix", app_id="bench", max_steps=10_000)
def mix_workflow(run, input):
    """The 3-step mix: one TRANSACTIONAL, one IDEMPOTENT and one EXTERNAL step."""
    n = 0
    for _ in range(max(1, input["steps"] // 3)):
        for action in (Transactional, Idempotent, External):
            n = run.step(action, {"n": n})["n"]
    return {"n": n}


class Unit(Action):
    """A child's one step, charged one unit of the root's budget."""

    name = "bench.unit"
    effect = Effect.PURE

    def cost(self, input):
        return {"units": 1}

    def run(self, ctx, input):
        return succeeded({"i": input["i"]})


@workflow("bench.child", app_id="bench")
def child_workflow(run, input):
    return run.step(Unit, input)


@workflow("bench.fanout", app_id="bench", effect_budget={"units": 100_000}, max_steps=100_000)
def fanout_workflow(run, input):
    results = run.children("bench.child", [{"i": i} for i in range(input["children"])])
    return {"succeeded": sum(r.status == "succeeded" for r in results)}
