"""``async def`` hooks run by the worker with the guarantees of plain ones.

Coroutines do their database work through Django's async API; the thread
``sync_to_async`` uses keeps a connection, closed after each test.
"""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from k2b_workflows import (
    Action,
    Effect,
    InvalidInput,
    dry_run,
    start_workflow_run,
    succeeded,
)
from k2b_workflows.control import cancel_run
from k2b_workflows.models import LedgerEntry
from k2b_workflows.testing import (
    assert_run_status,
    crash_after_effect,
    run_until_idle,
)
from tests.models import ProviderCall
from tests.support.kernel import describe, fresh, ledger_kinds
from tests.workflows.callers import ASYNC_CANCELLED, ASYNC_STARTED, AsyncCharge, calls

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _close_async_connections():
    yield
    asyncio.run(sync_to_async(connections.close_all)())


def test_an_async_run_is_awaited_and_its_result_journaled():
    run = start_workflow_run("callers.async_add", {"a": 2, "b": 3})
    run_until_idle(app_ids=["tests"])
    assert_run_status(run, "succeeded")
    assert fresh(run).output == {"sum": 5}
    assert calls("callers.async_add") == 1


def test_async_authorize_refuses_and_async_plan_serves_the_dry_run():
    refused = start_workflow_run("callers.async_guarded", {"to": "mallory"})
    allowed = start_workflow_run("callers.async_guarded", {"to": "alice"})
    run_until_idle(app_ids=["tests"])
    assert_run_status(refused, "failed", error_code="FORBIDDEN")
    assert_run_status(allowed, "succeeded")
    assert list(ProviderCall.objects.values_list("payload", flat=True)) == ["alice"]

    report = dry_run("callers.async_guarded", {"to": "bob"})
    assert [s.summary for s in report.steps] == ["would send bob"]
    assert calls("callers.async_guarded") == 1  # the dry run called plan(), not run()


def test_cancel_cancels_the_awaiting_task_and_its_late_result_is_discarded():
    ASYNC_STARTED.clear()
    ASYNC_CANCELLED.clear()
    run = start_workflow_run("callers.async_forever", {})
    worker = threading.Thread(
        target=lambda: (run_until_idle(app_ids=["tests"]), connections.close_all())
    )
    worker.start()
    assert ASYNC_STARTED.wait(30), describe(run)
    # Ended at once (as a timeout ends it): a cancel_workflow_run only asks (#49).
    cancel_run(run.pk, "stop it")
    assert ASYNC_CANCELLED.wait(30), "the task was never cancelled"
    worker.join(60)
    assert not worker.is_alive()
    assert_run_status(run, "canceled", error_code="CANCELED")
    assert fresh(run).output is None  # {"late": True} was never applied


def test_an_async_run_past_its_timeout_is_cancelled_and_tried_again():
    run = start_workflow_run("callers.async_slow_once", {})
    run_until_idle(app_ids=["tests"], timeout=120)
    assert_run_status(run, "succeeded")
    assert fresh(run).output == {"first": False}
    assert list(ProviderCall.objects.order_by("id").values_list("payload", flat=True)) == [
        "first",
        "again",
    ]


def test_an_async_external_effect_crashed_after_is_reconciled_by_its_async_lookup():
    run = start_workflow_run("callers.async_charge", {"amount": 7})
    with crash_after_effect(AsyncCharge):
        run_until_idle(app_ids=["tests"])
    assert_run_status(run, "succeeded")
    assert fresh(run).output == {"charged": 7, "reconciled": True}
    assert calls("callers.async_charge") == 1
    assert LedgerEntry.Kind.RECONCILED in ledger_kinds(run)


@pytest.mark.crash
def test_sigkill_during_an_async_external_hook_changes_nothing_of_the_outcome(start_worker, wait):
    run = start_workflow_run("callers.async_charge", {"amount": 9})
    first = start_worker("--concurrency", "1", env={"K2B_TEST_CRASH": "async_external"})
    assert first.wait(90) == -signal.SIGKILL, first.output()
    assert calls("callers.async_charge") == 1
    second = start_worker("--concurrency", "1")
    wait(lambda: fresh(run).status == "succeeded", timeout=90, message=second.report)
    assert fresh(run).output == {"charged": 9, "reconciled": True}
    assert calls("callers.async_charge") == 1  # reconciled, never charged again
    kinds = ledger_kinds(run)
    assert kinds.count(LedgerEntry.Kind.DISPATCHED) == 1
    assert LedgerEntry.Kind.RECONCILED in kinds


def test_an_async_cost_and_an_async_transactional_run_are_refused_at_definition():
    with pytest.raises(InvalidInput, match=r"AsyncCost\.cost must be a plain def"):

        class AsyncCost(Action):
            effect = Effect.IDEMPOTENT

            async def cost(self, input):
                return {"emails": 1}

    with pytest.raises(InvalidInput, match=r"AsyncTx\.run must be a plain def"):

        class AsyncTx(Action):
            effect = Effect.TRANSACTIONAL

            async def run(self, ctx, input):
                return succeeded({})
