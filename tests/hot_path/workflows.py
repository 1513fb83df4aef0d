"""Actions and workflows of the hot-path tests (app ``hot``).

Imported by those tests only, not by ``tests/workflows/__init__.py``: worker subprocesses
never load them, as when they were defined in the tests' own module.
"""

from __future__ import annotations

from django.db import connections

from k2b_workflows import Action, Effect, failed, succeeded, workflow
from k2b_workflows.exceptions import StepFailed
from k2b_workflows.kernel import evidence
from k2b_workflows.models import JournalEntry
from tests.models import DomainRow


class AddOne(Action):
    name = "hot.add_one"
    effect = Effect.PURE

    def run(self, ctx, input):
        return succeeded({"n": input["n"] + 1})


class Dispatch(Action):
    name = "hot.dispatch"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        return succeeded({"n": input["n"] + 1, "key": ctx.invocation_key})

    def reconcile(self, ctx, input):
        return succeeded({"n": input["n"] + 1, "key": ctx.invocation_key})


class DispatchAfterStep(Action):
    """EXTERNAL whose provider notes how many of the run's steps were journaled when called."""

    name = "hot.dispatch_after_step"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        before = JournalEntry.objects.filter(run_id=ctx.run_id, seq__lt=ctx.step).count()
        return succeeded({"journaled_before_call": before})

    reconcile = run


@workflow("hot.pure_then_external", app_id="hot")
def pure_then_external(run, input):
    run.step(AddOne, {"n": 0})
    return run.step(DispatchAfterStep, {})


def _three_steps(action: type[Action]):
    """A workflow body: three steps of ``action``, each adding one to ``n``."""

    def body(run, input):
        n = input["n"]
        for _ in range(3):
            n = run.step(action, {"n": n})["n"]
        return {"n": n}

    return body


three_pure = workflow("hot.three_pure", app_id="hot")(_three_steps(AddOne))


@workflow("hot.external_then_pure", app_id="hot")
def external_then_pure(run, input):
    n = run.step(Dispatch, {"n": input["n"]})["n"]
    return run.step(AddOne, {"n": n})


class DispatchThenNote(Action):
    """EXTERNAL whose call also leaves a note in the run's ledger, as a fenced-out
    worker's late result would: the executor's idea of the ledger's end goes stale."""

    name = "hot.dispatch_then_note"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        evidence.append_ledger(
            "default", run_id=ctx.run_id, seq=ctx.step, kind="late_result", message="a note"
        )
        return succeeded({"n": input["n"] + 1})

    reconcile = run


three_external = workflow("hot.three_external", app_id="hot")(_three_steps(Dispatch))


@workflow("hot.two_noted", app_id="hot")
def two_noted(run, input):
    n = run.step(DispatchThenNote, {"n": input["n"]})["n"]
    return run.step(DispatchThenNote, {"n": n})


#: ``on_commit`` hooks of TRANSACTIONAL steps, in the order they ran.
committed_hooks: list[str] = []


class WriteRow(Action):
    """TRANSACTIONAL: one domain row in ``ctx.tx``, and a hook for once it commits."""

    name = "hot.write_row"
    effect = Effect.TRANSACTIONAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        from django.db import transaction

        DomainRow.objects.using(ctx.tx.using).create(key=ctx.effect_key)
        transaction.on_commit(lambda: committed_hooks.append(ctx.effect_key), using=ctx.tx.using)
        return succeeded({"n": input["n"] + 1})


class WriteRowThenLose(WriteRow):
    """Writes its row, then, in the same transaction, moves the run to another
    generation, as a takeover would were the fence not holding the row's lock."""

    name = "hot.write_row_then_lose"

    def run(self, ctx, input):
        result = super().run(ctx, input)
        with connections[ctx.tx.using].cursor() as cursor:
            cursor.execute(
                "UPDATE k2b_run SET generation = generation + 1 WHERE id = %s", [ctx.run_id]
            )
        return result


@workflow("hot.transactional_then_lost", app_id="hot")
def transactional_then_lost(run, input):
    return run.step(WriteRowThenLose, {"n": 0})


@workflow("hot.two_transactional", app_id="hot")
def two_transactional(run, input):
    n = run.step(WriteRow, {"n": input["n"]})["n"]
    return run.step(WriteRow, {"n": n})


@workflow("hot.pure_then_transactional", app_id="hot")
def pure_then_transactional(run, input):
    n = run.step(AddOne, {"n": input["n"]})["n"]
    return run.step(WriteRow, {"n": n})


class WriteRowThenRefuse(WriteRow):
    """Writes its row, then answers that the effect failed: the block rolls back."""

    name = "hot.write_row_then_refuse"

    def run(self, ctx, input):
        super().run(ctx, input)
        return failed("refused after writing", code="REFUSED")


@workflow("hot.pure_then_refused", app_id="hot")
def pure_then_refused(run, input):
    n = run.step(AddOne, {"n": input["n"]})["n"]
    try:
        run.step(WriteRowThenRefuse, {"n": n})
    except StepFailed:
        return {"n": n, "refused": True}
    raise AssertionError("the step should have failed")


@workflow("hot.pure_then_lost", app_id="hot")
def pure_then_lost(run, input):
    n = run.step(AddOne, {"n": input["n"]})["n"]
    return run.step(WriteRowThenLose, {"n": n})


@workflow("hot.pure_then_wait", app_id="hot")
def pure_then_wait(run, input):
    """Two PURE steps, then a PURE step that waits: their successes ride on the park."""
    from tests.workflows import WaitFor

    n = run.step(AddOne, {"n": input["n"]})["n"]
    n = run.step(AddOne, {"n": n})["n"]
    return run.step(WaitFor, {"key": f"gate-{n}"})
