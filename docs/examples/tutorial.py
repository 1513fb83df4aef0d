"""docs/tutorial.md, step 2: whoever approves a large order wakes its checkout."""

from example_project.demo.models import Approval
from k2b_workflows import wake_workflow_runs_waiting_on


def approve(request, order_id):
    """The demo shop's approval, as a view would do it (the page shows the body)."""
    # --8<-- [start:approve]
    Approval.objects.create(order_id=order_id, approved_by=request.user.email)
    wake_workflow_runs_waiting_on(app_id="shop", kind="approval", key=f"order-{order_id}")
    # --8<-- [end:approve]
