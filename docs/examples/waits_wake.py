"""docs/waits.md: the view that wakes the run waiting for its approval."""

# --8<-- [start:approve]
from django.db import transaction

from k2b_workflows import wake_workflow_runs_waiting_on

from .models import Approval


def approve(request, order_id):
    with transaction.atomic():
        Approval.objects.create(order_id=order_id, user=request.user)
        wake_workflow_runs_waiting_on(app_id="shop", kind="approval", key=f"order-{order_id}")
# --8<-- [end:approve]
