"""docs/waits.md, "Deadlines": a step that gives up when nobody approved in time."""

# --8<-- [start:approval_expires]
import datetime as dt

from k2b_workflows import Action, Dependency, Effect, failed, succeeded, waiting

from .models import Approval


class WaitForApprovalOrExpire(Action):
    name = "shop.wait_for_approval_or_expire"
    effect = Effect.PURE

    def run(self, ctx, input):
        approval = Approval.objects.filter(order_id=input["order"]).first()
        if approval is not None:
            return succeeded({"approved_by": approval.user_id})
        if ctx.deadline_passed:  # run again because the 24 hours ran out, not woken
            return failed(
                f"nobody approved by {ctx.now():%Y-%m-%d %H:%M} UTC", code="APPROVAL_EXPIRED"
            )
        return waiting(
            Dependency("approval", f"order-{input['order']}", deadline=dt.timedelta(hours=24))
        )


# --8<-- [end:approval_expires]
