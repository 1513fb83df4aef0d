"""``ctx.now()`` and ``ctx.deadline_passed``: an action reads the kernel's clock and its deadline.

A step that waits with a deadline runs again when the deadline passes, with
the same ``effect_key``: without being told, it could not tell a deadline from
a wake (the user wrote ``SELECT k2b_now()`` by hand and compared). Every test
moves the clock days ahead first, so an action reading real time instead of
the kernel's would be days off.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.db import connection

from k2b_workflows import (
    Action,
    Dependency,
    Effect,
    start_workflow_run,
    succeeded,
    waiting,
    wake_workflow_runs_waiting_on,
    workflow,
)
from k2b_workflows.testing import run_until_idle
from tests.support.kernel import fresh

pytest_plugins = ["k2b_workflows.pytest_plugin"]

#: What each call of an action saw: (action, step, deadline_passed, ctx.now()).
SEEN: list[tuple[str, int, bool, dt.datetime]] = []


class AwaitReply(Action):
    """Waits a day for a reply; past the deadline, it gives up and says so."""

    name = "stepclock.await_reply"
    effect = Effect.PURE

    def run(self, ctx: Any, input: Any) -> Any:
        SEEN.append((self.name, ctx.step, ctx.deadline_passed, ctx.now()))
        if ctx.deadline_passed:
            return succeeded({"reply": None, "gave_up_at": ctx.now().isoformat()})
        if input.get("replied"):
            return succeeded({"reply": "yes"})
        return waiting(Dependency("reply", input["key"], deadline=dt.timedelta(days=1)))


class Record(Action):
    name = "stepclock.record"
    effect = Effect.PURE

    def run(self, ctx: Any, input: Any) -> Any:
        SEEN.append((self.name, ctx.step, ctx.deadline_passed, ctx.now()))
        return succeeded({})


@workflow("stepclock.ask", app_id="stepclock")
def ask(run: Any, input: Any) -> Any:
    reply = run.step(AwaitReply, {"key": input["key"], "replied": input.get("replied", False)})
    run.step(Record, {})
    return reply


@pytest.fixture(autouse=True)
def _clean_seen():
    SEEN.clear()
    yield
    SEEN.clear()


def _database_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT k2b_now()")
        return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_a_step_rerun_at_its_deadline_knows_the_deadline_passed(k2b_clock):
    k2b_clock.advance(days=3)
    run = start_workflow_run("stepclock.ask", {"key": "r-1"})
    run_until_idle(timeout=20)
    deadline = fresh(run).wait_deadline
    assert fresh(run).status == "waiting"

    k2b_clock.advance_to(deadline)
    run_until_idle(timeout=20)

    done = fresh(run)
    assert done.status == "succeeded"
    assert done.output["reply"] is None
    # The first call was not past its deadline, the re-run was; the next step is not.
    assert [(name, step, passed) for name, step, passed, _ in SEEN] == [
        ("stepclock.await_reply", 0, False),
        ("stepclock.await_reply", 0, True),
        ("stepclock.record", 1, False),
    ]
    assert dt.datetime.fromisoformat(done.output["gave_up_at"]) >= deadline


@pytest.mark.django_db(transaction=True)
def test_a_step_woken_before_its_deadline_is_not_told_it_passed(k2b_clock):
    k2b_clock.advance(days=3)
    run = start_workflow_run("stepclock.ask", {"key": "r-2"})
    run_until_idle(timeout=20)
    assert fresh(run).status == "waiting"

    k2b_clock.advance(hours=23)
    wake_workflow_runs_waiting_on(app_id="stepclock", kind="reply", key="r-2")
    run_until_idle(timeout=20)

    # Woken, not timed out: asked again, it waits again (nobody replied).
    assert fresh(run).status == "waiting"
    assert [(step, passed) for _, step, passed, _ in SEEN] == [(0, False), (0, False)]


@pytest.mark.django_db(transaction=True)
def test_ctx_now_is_the_kernels_clock_not_real_time(k2b_clock):
    k2b_clock.advance(days=5)
    start_workflow_run("stepclock.ask", {"key": "r-3", "replied": True})
    run_until_idle(timeout=20)

    seen_now = [now for *_, now in SEEN]
    assert len(seen_now) == 2
    database_now = _database_now()
    for now in seen_now:
        assert now.tzinfo is not None
        # Five days ahead of real time, within moments of what k2b_now() reads.
        assert abs(database_now - now) < dt.timedelta(minutes=1)
        assert now - dt.datetime.now(dt.UTC) > dt.timedelta(days=4)
