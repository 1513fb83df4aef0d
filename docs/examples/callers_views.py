"""docs/callers.md: views that start a run and answer with its result."""

# --8<-- [start:sync_view]
from django.http import JsonResponse

from k2b_workflows import start_workflow_run, wait_for_workflow_run


def remind(request):
    run = start_workflow_run(
        "reminders.remind_now", {"to": request.POST["to"]}, idempotency_key=request.POST["key"]
    )
    try:
        done = wait_for_workflow_run(run.pk, timeout=5)
    except TimeoutError:  # still queued, running or waiting: answer later
        return JsonResponse({"run": str(run.pk), "status": "pending"}, status=202)
    return JsonResponse({"run": str(run.pk), "status": done.status, "output": done.output})
# --8<-- [end:sync_view]


# --8<-- [start:async_view]
from k2b_workflows import astart_workflow_run, await_workflow_run  # noqa: E402


async def aremind(request):
    run = await astart_workflow_run(
        "reminders.remind_now", {"to": request.POST["to"]}, idempotency_key=request.POST["key"]
    )
    try:
        done = await await_workflow_run(run.pk, timeout=5)
    except TimeoutError:
        return JsonResponse({"run": str(run.pk), "status": "pending"}, status=202)
    return JsonResponse({"run": str(run.pk), "status": done.status, "output": done.output})
# --8<-- [end:async_view]
