"""Async views for the ASGI tests of the async twins (``tests/kernel/test_results_async.py``)."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.urls import path

from k2b_workflows import acancel_workflow_run, astart_workflow_run, await_workflow_run


async def gated(request: HttpRequest) -> JsonResponse:
    """Start a gated run and answer with its result: the view awaits the run's end."""
    run = await astart_workflow_run(
        "waits.gate", {"key": request.GET["key"]}, idempotency_key=request.GET["key"]
    )
    done = await await_workflow_run(run.pk, timeout=float(request.GET.get("timeout", 60)))
    return JsonResponse({"id": str(done.pk), "status": done.status, "output": done.output})


async def cancel(request: HttpRequest, run_id: str) -> JsonResponse:
    run = await acancel_workflow_run(run_id, request.GET.get("reason", "from a view"))
    return JsonResponse({"status": run.status, "error_code": run.error_code})


urlpatterns = [
    path("gated/", gated),
    path("cancel/<str:run_id>/", cancel),
]
