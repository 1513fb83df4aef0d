"""The soak's actions and workflows: every effect class, waits and fan-out.

Every effect leaves a row the invariant report can count:

- ``soak_effect``: one row per TRANSACTIONAL write (in the kernel's transaction)
  and per IDEMPOTENT effect (in a fenced transaction, only when ``insert_once``
  created the dedup record). Two rows for one step are a duplicate effect.
- ``soak_provider_call``: the EXTERNAL provider's own record of every call,
  written on a connection of its own (autocommit), keyed by ``effect_key``,
  with the time it came in and the time it returned to its caller.
  Two calls for one step are a duplicate effect.
- ``soak_reconcile``: every ``reconcile()`` lookup, when it asked and what it
  found. One that asked while a call of its step was still in flight raced it.
- ``soak_gate``: the gates the waker opens; a waiting step checks its gate.

Actions sleep a few milliseconds around their effects so that a killed or
frozen worker is often caught in the middle of one. The tables are created by
``bench/soak.py`` (this app has no migrations).
"""

from __future__ import annotations

import datetime as dt
import os
import random
import time
from typing import Any

from django.db import DatabaseError, connection, connections

from k2b_workflows import (
    Action,
    Dependency,
    Effect,
    failed,
    succeeded,
    waiting,
    workflow,
)
from k2b_workflows.dedup import insert_once
from k2b_workflows.models import DedupRecord

APP = "soak"
#: Upper bound of the pause an action takes before and after its effect (the
#: starvation soak lengthens it: more of a worker's time is spent inside calls).
JITTER_S = int(os.environ.get("K2B_SOAK_JITTER_MS", "20")) / 1000
#: How long a provider write that lost its connection is tried again.
PROVIDER_PATIENCE_S = 60.0


def pause() -> None:
    time.sleep(random.uniform(0, JITTER_S))


def record_effect(using: str, kind: str, ctx: Any) -> None:
    with connections[using].cursor() as cursor:
        cursor.execute(
            "INSERT INTO soak_effect (kind, run_id, seq, effect_key, generation, pid) "
            "VALUES (%s, %s, %s, %s, %s, %s)",
            [kind, ctx.run_id, ctx.step, ctx.effect_key, ctx.generation, os.getpid()],
        )


def provider() -> Any:
    """The provider's connection, reopened if a restart or a terminated backend broke it.

    A provider client reconnects before it sends; what it cannot know is whether a
    call whose answer was lost went through, and that is what ``reconcile`` is for.
    """
    conn = connections["provider"]
    if conn.connection is not None and not conn.is_usable():
        conn.close()
    return conn


def provider_write(sql: str, params: list[Any]) -> None:
    """An idempotent provider write, tried again until it lands (a restart, a killed backend).

    For what the soak records about a call that already happened (that it
    returned): giving up would leave the call looking in flight for ever.
    """
    deadline = time.monotonic() + PROVIDER_PATIENCE_S
    while True:
        try:
            with provider().cursor() as cursor:
                cursor.execute(sql, params)
            return
        except DatabaseError:
            connections["provider"].close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


#: The call has returned to its caller (with its answer, or an error).
LEFT_SQL = (
    "UPDATE soak_provider_call SET left_at = clock_timestamp()"
    " WHERE invocation_key = %s AND left_at IS NULL"
)

#: The lookup and its record in one statement: what the reconcile saw is what is recorded.
RECONCILE_SQL = """
WITH found AS (SELECT min(id) AS id FROM soak_provider_call WHERE effect_key = %s)
INSERT INTO soak_reconcile (run_id, seq, effect_key, generation, pid, found, call_id)
SELECT %s, %s, %s, %s, %s, found.id IS NOT NULL, found.id FROM found
RETURNING call_id
"""


def provider_lookup(ctx: Any) -> int | None:
    try:
        with provider().cursor() as cursor:
            cursor.execute(
                RECONCILE_SQL,
                [ctx.effect_key, ctx.run_id, ctx.step, ctx.effect_key, ctx.generation, os.getpid()],
            )
            return cursor.fetchone()[0]
    except DatabaseError:
        connections["provider"].close()
        raise


class Compute(Action):
    name = "soak.compute"
    effect = Effect.PURE

    def run(self, ctx, input):
        pause()
        return succeeded({"n": input["n"] + 1})


class WriteRow(Action):
    """TRANSACTIONAL: its row commits with the journal entry or not at all."""

    name = "soak.write_row"
    effect = Effect.TRANSACTIONAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        record_effect(ctx.tx.using, "transactional", ctx)
        pause()
        return succeeded({"n": input["n"] + 1})


class SendNotice(Action):
    """IDEMPOTENT through the kernel's dedup table: the effect happens once per effect key."""

    name = "soak.send_notice"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        pause()
        with ctx.fenced():
            _, created = insert_once(
                DedupRecord,
                key=f"soak:{ctx.effect_key}",
                run_id=ctx.run_id,
                step=ctx.step,
                name=self.name,
                value={"n": input["n"]},
            )
            if created:
                record_effect("default", "idempotent", ctx)
        pause()
        return succeeded({"n": input["n"] + 1})


class Charge(Action):
    """EXTERNAL with reconcile: the provider knows its calls by effect key."""

    name = "soak.charge"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        pause()
        try:
            with provider().cursor() as cursor:
                cursor.execute(
                    "INSERT INTO soak_provider_call (action, run_id, seq, effect_key, "
                    "invocation_key, generation, pid) VALUES (%s, %s, %s, %s, %s, %s, %s) "
                    "RETURNING id",
                    [
                        self.name,
                        ctx.run_id,
                        ctx.step,
                        ctx.effect_key,
                        ctx.invocation_key,
                        ctx.generation,
                        os.getpid(),
                    ],
                )
                (call_id,) = cursor.fetchone()
        except DatabaseError:
            # The insert's answer was lost: the call may have gone through, and it is over.
            connections["provider"].close()
            provider_write(LEFT_SQL, [ctx.invocation_key])
            raise
        pause()
        provider_write(LEFT_SQL, [ctx.invocation_key])
        return succeeded({"n": input["n"] + 1, "call": call_id})

    def reconcile(self, ctx, input):
        try:
            call_id = provider_lookup(ctx)
        except DatabaseError:
            # The provider cannot be asked now; ask again in a second.
            return waiting(Dependency("soak.provider", ctx.effect_key, dt.timedelta(seconds=1)))
        if call_id is None:
            return failed("the provider has no such call", code="PROVIDER_ABSENT")
        return succeeded({"n": input["n"] + 1, "call": call_id, "reconciled": True})


class ChargeBlind(Charge):
    """EXTERNAL without reconcile: after any doubt, an operator decides."""

    name = "soak.charge_blind"
    reconcile = Action.reconcile


class Gate(Action):
    """PURE: waits until the waker opens the gate named by the input."""

    name = "soak.gate"
    effect = Effect.PURE

    def run(self, ctx, input):
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM soak_gate WHERE key = %s", [input["key"]])
            if cursor.fetchone() is not None:
                return succeeded({"n": input["n"] + 1})
        deadline = dt.timedelta(seconds=input["deadline_s"])
        return waiting(Dependency("soak.gate", input["key"], deadline=deadline))


@workflow("soak.chain", app_id=APP)
def chain(run, input):
    n = run.step(Compute, {"n": input["i"]})["n"]
    n = run.step(WriteRow, {"n": n})["n"]
    n = run.step(SendNotice, {"n": n})["n"]
    n = run.step(Charge, {"n": n})["n"]
    return run.step(Compute, {"n": n})


@workflow("soak.blind", app_id=APP)
def blind(run, input):
    n = run.step(WriteRow, {"n": input["i"]})["n"]
    n = run.step(ChargeBlind, {"n": n})["n"]
    return run.step(SendNotice, {"n": n})


@workflow("soak.wait", app_id=APP)
def wait(run, input):
    n = run.step(Compute, {"n": input["i"]})["n"]
    # Short deadlines on some runs: the step is re-run at its deadline and waits again.
    deadline_s = 2 if input["i"] % 4 == 0 else 60
    n = run.step(Gate, {"n": n, "key": f"gate-{input['i']}", "deadline_s": deadline_s})["n"]
    n = run.step(WriteRow, {"n": n})["n"]
    return run.step(Charge, {"n": n})


@workflow("soak.fanout", app_id=APP)
def fanout(run, input):
    n = run.step(Compute, {"n": input["i"]})["n"]
    children = run.children("soak.child", [{"i": n * 10 + k} for k in range(3)])
    statuses = sorted(child.status for child in children)
    run.step(WriteRow, {"n": n})
    return {"children": statuses}


@workflow("soak.child", app_id=APP)
def child(run, input):
    n = run.step(SendNotice, {"n": input["i"]})["n"]
    n = run.step(WriteRow, {"n": n})["n"]
    return run.step(Charge, {"n": n})


#: The root workflows the harness starts, with their weights in the mix.
MIX = {"soak.chain": 4, "soak.blind": 1, "soak.wait": 2, "soak.fanout": 1}
