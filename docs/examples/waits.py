"""docs/waits.md: a step that waits for a person."""

# --8<-- [start:wait_for_approval]
import datetime as dt

from k2b_workflows import Action, Dependency, Effect, succeeded, waiting

from .models import Approval


class WaitForApproval(Action):
    name = "shop.wait_for_approval"
    effect = Effect.PURE

    def run(self, ctx, input):
        approval = Approval.objects.filter(order_id=input["order"]).first()
        if approval is None:
            return waiting(Dependency("approval", f"order-{input['order']}",
                                      deadline=dt.timedelta(hours=24)))
        return succeeded({"approved_by": approval.user_id})
# --8<-- [end:wait_for_approval]
