"""The async twins from an ASGI view (Django's ``AsyncClient``), never blocking the loop.

Each test runs a request whose view awaits a run's end *and*, on the same
event loop, the coroutine that makes the run end (a wake, a cancel). Were
``await_workflow_run`` to block the loop, that coroutine could not run until
the view's timeout: the test would fail instead of answering.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.test import AsyncClient, override_settings

from k2b_workflows import (
    InvalidInput,
    UnknownWorkflow,
    acancel_workflow_run,
    astart_workflow_run,
    await_workflow_run,
    awake_workflow_runs_waiting_on,
)
from k2b_workflows.models import WorkflowRun
from tests.models import DomainRow

pytestmark = [pytest.mark.django_db(transaction=True)]
ASGI = override_settings(ROOT_URLCONF="tests.support.urls_results")


@pytest.fixture(autouse=True)
def _close_async_connections():
    """The thread ``sync_to_async`` runs ORM calls in keeps a connection: close it."""
    yield
    asyncio.run(sync_to_async(connections.close_all)())


async def parked(key: str, timeout: float = 60) -> WorkflowRun:
    """The gated run of ``key`` once a worker has parked it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        run = await WorkflowRun.objects.filter(idempotency_key=key).afirst()
        if run is not None and run.status == "waiting":
            return run
        assert loop.time() < deadline, f"run {key} never parked"
        await asyncio.sleep(0.05)


@ASGI
def test_an_async_view_awaits_the_result_while_the_loop_serves_the_wake(start_worker):
    worker = start_worker("--concurrency", "2")

    async def scenario():
        client = AsyncClient()
        request = asyncio.create_task(client.get("/gated/", {"key": "async-ok"}))
        run = await parked("async-ok")
        await DomainRow.objects.acreate(key="async-ok", value=42)
        assert (
            await awake_workflow_runs_waiting_on(app_id="tests", kind="gate", key="async-ok") == 1
        )
        return run, await asyncio.wait_for(request, 90)

    run, response = asyncio.run(scenario())
    assert response.status_code == 200, worker.report()
    assert response.json() == {"id": str(run.pk), "status": "succeeded", "output": {"value": 42}}


@ASGI
def test_an_async_view_sees_a_cancel_made_by_another_async_view(start_worker):
    start_worker("--concurrency", "2")

    async def scenario():
        client = AsyncClient()
        request = asyncio.create_task(client.get("/gated/", {"key": "async-cancel"}))
        run = await parked("async-cancel")
        canceled = await client.get(f"/cancel/{run.pk}/", {"reason": "changed my mind"})
        return canceled, await asyncio.wait_for(request, 90)

    canceled, response = asyncio.run(scenario())
    assert canceled.json() == {"status": "canceled", "error_code": "CANCELED"}
    assert response.json()["status"] == "canceled"


def test_the_twins_raise_what_their_originals_raise():
    async def scenario():
        with pytest.raises(UnknownWorkflow):
            await astart_workflow_run("no.such.workflow", {})
        with pytest.raises(InvalidInput, match="None"):
            await astart_workflow_run("test.pure", None)
        run = await astart_workflow_run("test.pure", {"a": 1, "b": 2}, idempotency_key="same")
        again = await astart_workflow_run("test.pure", {"a": 1, "b": 2}, idempotency_key="same")
        assert again.pk == run.pk
        with pytest.raises(InvalidInput, match="reason"):
            await acancel_workflow_run(run.pk, "")
        with pytest.raises(InvalidInput, match="key"):
            await awake_workflow_runs_waiting_on(app_id="tests", kind="gate", key="")
        with pytest.raises(TimeoutError):
            await await_workflow_run(run.pk, timeout=0.1)
        with pytest.raises(InvalidInput, match="timeout"):
            await await_workflow_run(run.pk, timeout=-1)
        with pytest.raises(WorkflowRun.DoesNotExist, match="run_id"):
            await await_workflow_run(uuid.uuid4(), timeout=1)
        canceled = await acancel_workflow_run(run.pk, "done testing")
        assert canceled.status == "canceled"
        assert (await await_workflow_run(run.pk)).status == "canceled"
        return await sync_to_async(WorkflowRun.objects.count)()

    assert asyncio.run(scenario()) == 1


#: Each async twin of the public API and its sync original.
TWINS = {
    "astart_workflow_run": "start_workflow_run",
    "await_workflow_run": "wait_for_workflow_run",
    "acancel_workflow_run": "cancel_workflow_run",
    "awake_workflow_runs_waiting_on": "wake_workflow_runs_waiting_on",
}


def test_every_async_twin_takes_exactly_its_originals_parameters():
    """Same names, kinds and defaults: an argument the sync original takes and its
    twin refused (``concurrency_key``, ``priority``, ``run_after``) was a TypeError (#38)."""
    import k2b_workflows

    public_coroutines = {
        name
        for name in k2b_workflows.__all__
        if inspect.iscoroutinefunction(getattr(k2b_workflows, name))
    }
    assert public_coroutines == set(TWINS), "a new async twin belongs in TWINS"
    for twin, original in TWINS.items():
        theirs = inspect.signature(getattr(k2b_workflows, original)).parameters
        ours = inspect.signature(getattr(k2b_workflows, twin)).parameters
        assert [(p.name, p.kind, p.default) for p in ours.values()] == [
            (p.name, p.kind, p.default) for p in theirs.values()
        ], twin


def test_astart_workflow_run_passes_flow_control_and_scheduling_through():
    from datetime import timedelta

    from django.utils import timezone

    later = timezone.now() + timedelta(hours=1)

    async def scenario():
        return await astart_workflow_run(
            "flow.keyed", {}, concurrency_key="customer-7", priority=9, run_after=later
        )

    run = asyncio.run(scenario())
    run.refresh_from_db()
    assert (run.concurrency_key, run.priority, run.run_after) == ("customer-7", 9, later)
