"""Actions, workflows and AI providers for the fan-out, budget, dry-run and AI task tests.

Every simulated external call is a ``ProviderCall`` row committed on its own,
so a test can count exactly which effects happened.
"""

from __future__ import annotations

import os
import time

from django.core.exceptions import PermissionDenied

from k2b_workflows import (
    Action,
    Effect,
    ai_provider,
    create_child_workflow_runs,
    failed,
    succeeded,
    workflow,
)
from tests.models import ProviderCall
from tests.workflows import Add, crash_point

APP = "fanout"


def _record(action: str, ctx=None, **payload) -> ProviderCall:
    return ProviderCall.objects.create(
        action=action,
        effect_key=getattr(ctx, "effect_key", ""),
        generation=getattr(ctx, "generation", 0),
        pid=os.getpid(),
        payload=payload or None,
    )


# -- actions -------------------------------------------------------------------


class Echo(Action):
    """PURE: returns its input; fails with a code when asked."""

    name = "fanout.echo"
    effect = Effect.PURE

    def run(self, ctx, input):
        if input.get("fail"):
            return failed("asked to fail", code=input["fail"])
        return succeeded({"echo": input.get("value")}, summary=f"echo {input.get('value')}")


class Send(Action):
    """IDEMPOTENT, one ``sends`` unit: the provider deduplicates by ``effect_key``."""

    name = "fanout.send"
    effect = Effect.IDEMPOTENT

    def cost(self, input):
        return {"sends": 1}

    def plan(self, ctx, input):
        return succeeded({"planned": True, "to": input.get("to")}, summary=f"Send to {input['to']}")

    def run(self, ctx, input):
        previous = ProviderCall.objects.filter(action=self.name, effect_key=ctx.effect_key).count()
        _record(self.name, ctx, to=input.get("to"))
        if previous < input.get("fail_times", 0):
            return failed(f"provider busy (attempt {previous + 1})", retryable=True)
        return succeeded({"sent": input.get("to")})


class GuardedSend(Send):
    """``Send`` behind ``authorize()``: a denied step must not spend the budget."""

    name = "fanout.guarded_send"

    def authorize(self, ctx, input):
        if input.get("deny"):
            raise PermissionDenied("sending is not allowed")


class Note(Action):
    """IDEMPOTENT without ``cost()``: charges nothing, still authorized and journaled."""

    name = "fanout.note"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def authorize(self, ctx, input):
        _record("fanout.note.authorize", ctx)
        if input.get("deny"):
            raise PermissionDenied("notes are not allowed")

    def run(self, ctx, input):
        _record(self.name, ctx)
        return succeeded({"noted": True})


class Pay(Action):
    """EXTERNAL with a plan and a cost: what a dry run must never call."""

    name = "fanout.pay"
    effect = Effect.EXTERNAL

    def cost(self, input):
        return {"payments": input.get("amount", 1)}

    def plan(self, ctx, input):
        if input.get("bad_plan"):
            return succeeded({"amount": input.get("amount")}, summary="forgot to say planned")
        return succeeded(
            {"planned": True, "amount": input.get("amount")}, summary=f"Pay {input.get('amount')}"
        )

    def authorize(self, ctx, input):
        roles = (ctx.principal or {}).get("roles", [])
        if "payer" not in roles:
            return failed("the principal may not pay", code="FORBIDDEN")
        return None

    def run(self, ctx, input):
        _record(self.name, ctx, amount=input.get("amount"))
        return succeeded({"paid": input.get("amount")})

    def reconcile(self, ctx, input):
        return failed("not found", retryable=True)


class Unplanned(Action):
    """IDEMPOTENT without ``plan()``: a dry run must report it, not call ``run()``."""

    name = "fanout.unplanned"
    effect = Effect.IDEMPOTENT

    def run(self, ctx, input):
        _record(self.name, ctx)
        return succeeded({"ran": True})


class Spawn(Action):
    """PURE: creates children from inside an action, then (optionally) crashes."""

    name = "fanout.spawn"
    effect = Effect.PURE

    def run(self, ctx, input):
        runs = create_child_workflow_runs(ctx, input["child"], input["inputs"])
        _record(self.name, ctx, created=len(runs))
        crash_point(input, "after_spawn")
        return succeeded({"children": [str(r.pk) for r in runs]})


class Linger(Action):
    """PURE: runs until the run is canceled (or ``limit_s``) and records when it noticed."""

    name = "fanout.linger"
    effect = Effect.PURE
    timeout = 60

    def run(self, ctx, input):
        _record("linger.started", ctx)
        saw_cancel = ctx.canceled.wait(float(input.get("limit_s", 30)))
        _record("linger.stopped", ctx, saw_cancel=saw_cancel, seen_at=time.time())
        return succeeded({"lingered": True})


class AskAi(Action):
    """PURE: a durable AI task; the step waits until the task is done."""

    name = "fanout.ask_ai"
    effect = Effect.PURE

    def run(self, ctx, input):
        return ctx.ai_task(input.get("provider", "fanout.echo"), input.get("request"))


# -- AI providers ------------------------------------------------------------------


@ai_provider("fanout.echo")
def echo_provider(request, abort):
    _record("ai.echo", request=request)
    return {"answer": request}


@ai_provider("fanout.boom")
def boom_provider(request, abort):
    raise RuntimeError("model overloaded")


@ai_provider("fanout.slow")
def slow_provider(request, abort):
    """Runs until aborted (or ``limit_s``), records when it saw the abort, returns anyway."""
    started = time.monotonic()
    _record("ai.slow.started", request=request)
    saw_abort = abort.wait(float((request or {}).get("limit_s", 30)))
    _record(
        "ai.slow.stopped",
        saw_abort=saw_abort,
        seen_at=time.time(),
        after_s=round(time.monotonic() - started, 3),
    )
    return {"late": True}


# -- workflows -------------------------------------------------------------------


@workflow("fanout.child", app_id=APP)
def child(run, input):
    return run.step(Echo, input)


@workflow("fanout.parent", app_id=APP)
def parent(run, input):
    results = run.children("fanout.child", input["items"])
    return [{"status": r.status, "output": r.output, "error_code": r.error_code} for r in results]


@workflow("fanout.parent_small", app_id=APP, max_steps=3)
def parent_small(run, input):
    results = run.children("fanout.child", input["items"])
    return {"children": len(results)}


@workflow("fanout.create_from_run", app_id=APP)
def create_from_run(run, input):
    runs = create_child_workflow_runs(run, "fanout.child", input["items"])
    run.step(Add, {"a": 1, "b": 1})
    return {"children": [str(r.pk) for r in runs]}


@workflow("fanout.create_from_ctx", app_id=APP, max_steps=3)
def create_from_ctx(run, input):
    return run.step(Spawn, {"child": "fanout.child", **input})


@workflow("fanout.send_one", app_id=APP)
def send_one(run, input):
    return run.step(Send, input)


@workflow("fanout.budget_3", app_id=APP, effect_budget={"sends": 3})
def budget_3(run, input):
    results = run.children("fanout.send_one", [{"to": f"c{i}"} for i in range(input["n"])])
    return [r.error_code or r.status for r in results]


@workflow("fanout.budget_20", app_id=APP, effect_budget={"sends": 20})
def budget_20(run, input):
    results = run.children("fanout.send_one", [{"to": f"c{i}"} for i in range(input["n"])])
    return [r.error_code or r.status for r in results]


@workflow("fanout.retry_send", app_id=APP, effect_budget={"sends": 1})
def retry_send(run, input):
    return run.step(Send, {"to": "x", "fail_times": input.get("fail_times", 1)})


@workflow("fanout.guarded_send", app_id=APP, effect_budget={"sends": 1})
def guarded_send(run, input):
    return run.step(GuardedSend, input)


@workflow("fanout.note", app_id=APP, effect_budget={"sends": 0})
def note(run, input):
    return run.step(Note, input)


@workflow("fanout.ai", app_id=APP, max_ai_calls=1)
def ask(run, input):
    return run.step(AskAi, input)


@workflow("fanout.ai_twice", app_id=APP, max_ai_calls=1)
def ask_twice(run, input):
    first = run.step(AskAi, {"request": "one"})
    second = run.step(AskAi, {"request": "two"})
    return [first, second]


@workflow("fanout.ai_children", app_id=APP)
def ai_children(run, input):
    results = run.children("fanout.ai", [{"request": i} for i in range(input["n"])])
    return [r.status for r in results]


@workflow("fanout.checkout", app_id=APP, effect_budget={"payments": 10, "sends": 2})
def checkout(run, input):
    total = run.step(Add, {"a": input["amount"], "b": 0})
    run.step(Pay, {"amount": total["sum"], "bad_plan": input.get("bad_plan", False)})
    run.step(Send, {"to": input.get("to", "buyer")})
    if input.get("unplanned"):
        run.step(Unplanned, {})
    return {"paid": total["sum"]}


@workflow("fanout.dry_tree", app_id=APP, effect_budget={"sends": 2}, max_ai_calls=1)
def dry_tree(run, input):
    run.step(AskAi, {"request": "summarize"})
    results = run.children("fanout.send_one", [{"to": t} for t in input["to"]])
    return {"sent": [r.status for r in results]}


@workflow("fanout.linger", app_id=APP)
def linger(run, input):
    run.step(Linger, input)
    return run.step(Echo, {"value": "after"})


@workflow("fanout.loop_children", app_id=APP, max_steps=2)
def loop_children(run, input):
    while True:  # a bug: only the loop budget ends it
        run.children("fanout.child", [])
