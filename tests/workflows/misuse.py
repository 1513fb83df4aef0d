"""Actions that produce values PostgreSQL cannot store, and workflows that never end dry."""

from __future__ import annotations

import contextlib

from k2b_workflows import (
    Action,
    Dependency,
    Effect,
    StepFailed,
    ai_provider,
    failed,
    succeeded,
    waiting,
    workflow,
)
from tests.support.workflow_steps import one_step


class Produce(Action):
    """PURE: returns what the input asks for, storable or not."""

    name = "misuse.produce"
    effect = Effect.PURE

    def run(self, ctx, input):
        kind = input["kind"]
        if kind == "nul_output":
            return succeeded({"text": "a\x00b"})
        if kind == "nul_summary":
            return succeeded({"ok": True}, summary="s\x00")
        if kind == "nul_failure":
            return failed("provider said \x00", code="PROVIDER_SAID_NO")
        if kind == "long_code":
            return failed("no", code="C" * 101)
        if kind == "long_wait_key":
            return waiting(Dependency("misuse", "k" * 501))
        if kind == "nul_wait_key":
            return waiting(Dependency("misuse", "k\x00"))
        if kind == "raise_nul":
            raise RuntimeError("boom \x00 here")
        return succeeded({"ok": True})


class ExternalNul(Action):
    """EXTERNAL: the effect happened, but the answer holds a NUL (no reconcile)."""

    name = "misuse.external_nul"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        return succeeded({"receipt": "r\x00"})


class AskAi(Action):
    name = "misuse.ask_ai"
    effect = Effect.PURE

    def run(self, ctx, input):
        return ctx.ai_task(input["provider"], input.get("request", {}))


@ai_provider("misuse.nul_answer")
def nul_answer(request, abort):
    return {"answer": "\x00"}


@ai_provider("misuse.nul_error")
def nul_error(request, abort):
    raise RuntimeError("quota \x00 exceeded")


one_step("misuse.produce", Produce)
one_step("misuse.external_nul", ExternalNul)
one_step("misuse.ask_ai", AskAi)


class Poll(Action):
    """PURE: never ready, so a loop over it only ends by a budget."""

    name = "misuse.poll"
    effect = Effect.PURE

    def run(self, ctx, input):
        return succeeded({"ready": False})


@workflow("misuse.poll_forever", app_id="tests", max_steps=20)
def poll_forever(run, input):
    while not run.step(Poll, {})["ready"]:
        pass


@workflow("misuse.poll_forever_catching", app_id="tests", max_steps=20)
def poll_forever_catching(run, input):
    while True:
        with contextlib.suppress(StepFailed):
            run.step(Poll, {})


@workflow("misuse.crashy", app_id="tests")
def crashy(run, input):
    return {"sku": input["sku"]}  # KeyError for an input without "sku"


@workflow("misuse.fan_out", app_id="tests", max_steps=5)
def fan_out(run, input):
    return [r.status for r in run.children("misuse.leaf", [{"i": i} for i in range(input["n"])])]


@workflow("misuse.leaf", app_id="tests")
def leaf(run, input):
    return run.step(Poll, input)
