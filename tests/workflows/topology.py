"""A workflow of every effect class, a wait and a fan-out, whose provider lives in another cluster.

For tests/crash/test_failover.py and tests/crash/test_partition.py: the database the
workers use fails over (or is cut off), the provider does not. Its records are
rows in ``provider_call`` on the PostgreSQL at ``K2B_TEST_PROVIDER_URL``, one
row per call, committed on its own: a second row for one EXTERNAL effect key
is a repeated effect, whatever happened to the workers' database.
"""

from __future__ import annotations

import datetime as dt
import os
import time

from k2b_workflows import Action, Dependency, Effect, failed, succeeded, waiting, workflow
from tests.models import DomainRow
from tests.workflows import Add, WriteRow

PROVIDER_TABLE = """
CREATE TABLE IF NOT EXISTS provider_call (
    id bigserial PRIMARY KEY,
    action text NOT NULL,
    effect_key text NOT NULL,
    generation bigint NOT NULL,
    pid integer NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


def provider_call(action: str, ctx) -> int:
    import psycopg

    with psycopg.connect(os.environ["K2B_TEST_PROVIDER_URL"], autocommit=True) as conn:
        (row_id,) = conn.execute(
            "INSERT INTO provider_call (action, effect_key, generation, pid)"
            " VALUES (%s, %s, %s, %s) RETURNING id",
            [action, ctx.effect_key, ctx.generation, os.getpid()],
        ).fetchone()
    return row_id


def provider_lookup(action: str, effect_key: str) -> int | None:
    import psycopg

    with psycopg.connect(os.environ["K2B_TEST_PROVIDER_URL"], autocommit=True) as conn:
        row = conn.execute(
            "SELECT min(id) FROM provider_call WHERE action = %s AND effect_key = %s",
            [action, effect_key],
        ).fetchone()
    return row[0]


class Nap(Action):
    """PURE: keeps a thread busy, so that a kill lands inside steps."""

    name = "topology.nap"
    effect = Effect.PURE

    def run(self, ctx, input):
        time.sleep(float(input.get("seconds", 0.1)))
        return succeeded({"napped": True})


class Timer(Action):
    """PURE: a durable wait on a deadline; the first execution parks, the next one goes on."""

    name = "topology.timer"
    effect = Effect.PURE

    def run(self, ctx, input):
        marker = f"timer:{ctx.effect_key}"
        if DomainRow.objects.filter(key=marker).exists():
            return succeeded({"waited": True})
        DomainRow.objects.get_or_create(key=marker, defaults={"generation": ctx.generation})
        return waiting(
            Dependency("timer", ctx.effect_key, deadline=dt.timedelta(seconds=input["seconds"]))
        )


class Notify(Action):
    """IDEMPOTENT: the provider deduplicates by effect key; the result is stored fenced."""

    name = "topology.notify"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        provider_call(self.name, ctx)
        with ctx.fenced():
            DomainRow.objects.create(
                key=f"idem:{ctx.effect_key}:{ctx.generation}", generation=ctx.generation
            )
        return succeeded({"sent": ctx.effect_key})


class Charge(Action):
    """EXTERNAL with reconcile: the provider knows charges by effect key."""

    name = "topology.charge"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True})

    def run(self, ctx, input):
        return succeeded({"charge_id": provider_call(self.name, ctx)})

    def reconcile(self, ctx, input):
        found = provider_lookup(self.name, ctx.effect_key)
        if found is None:
            return failed("no charge with this key", retryable=True)
        return succeeded({"charge_id": found, "reconciled": True})


@workflow("topology.child", app_id="tests")
def child(run, input):
    return run.step(Add, {"a": input["n"], "b": 1})


@workflow("topology.mixed", app_id="tests")
def mixed(run, input):
    key = input["key"]
    nap = input.get("nap", 0.1)
    total = run.step(Add, {"a": input.get("n", 0), "b": 1})
    run.step(Nap, {"seconds": nap})
    run.step(WriteRow, {"key": f"tx:{key}", "value": total["sum"]})
    run.step(Notify, {"to": key})
    run.step(Timer, {"seconds": input.get("wait", 0.2)})
    kids = run.children("topology.child", [{"n": i} for i in range(2)])
    run.step(Nap, {"seconds": nap})
    charge = run.step(Charge, {"amount": total["sum"]})
    return {"charge": charge["charge_id"], "children": len(kids)}
