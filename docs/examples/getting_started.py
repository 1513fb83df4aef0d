"""docs/getting-started.md: a first workflow, starting runs, and the README's checkout."""

# --8<-- [start:workflows]
# shop/workflows.py
from k2b_workflows import Action, Effect, failed, succeeded, workflow

from .models import Order
from .providers import gateway


class CreateOrder(Action):
    name = "shop.create_order"           # stable: the journal records it
    effect = Effect.TRANSACTIONAL        # commits with the journal entry

    def plan(self, ctx, input):          # dry runs: every non-PURE action has one
        return succeeded({"planned": True, "order_id": None}, summary=f"Order {input['sku']}")

    def run(self, ctx, input):
        order = Order.objects.using(ctx.tx.using).create(sku=input["sku"])
        return succeeded({"order_id": order.pk})


class ChargeCard(Action):
    name = "shop.charge_card"
    effect = Effect.EXTERNAL             # never repeated blindly after a crash

    def cost(self, input):
        return {"charges": 1}

    def plan(self, ctx, input):          # dry runs
        return succeeded({"planned": True, "charge_id": "planned"},
                         summary=f"Charge {input['amount']}")

    def run(self, ctx, input):
        charge = gateway.charge(input["amount"], idempotency_key=ctx.effect_key)
        return succeeded({"charge_id": charge.id})

    def reconcile(self, ctx, input):     # after a crash or a timeout
        charge = gateway.find(idempotency_key=ctx.effect_key)
        if charge is None:
            return failed("no such charge", code="CHARGE_ABSENT")   # the step fails
        return succeeded({"charge_id": charge.id})


# --8<-- [start:checkout]
@workflow("shop.checkout", app_id="shop", effect_budget={"charges": 1})
def checkout(run, input):
    order = run.step(CreateOrder, {"sku": input["sku"]})          # TRANSACTIONAL
    charge = run.step(ChargeCard, {"order": order["order_id"],    # EXTERNAL, reconciled by key
                                   "amount": input["amount"]})
    return {"order": order["order_id"], "charge": charge["charge_id"]}
# --8<-- [end:checkout]
# --8<-- [end:workflows]


def start_checkout(request, cart):
    """A view's part: what the page shows, with the request and cart it names."""
    # --8<-- [start:start_run]
    from k2b_workflows import start_workflow_run

    run = start_workflow_run("shop.checkout", {"sku": "TEA-01", "amount": 2900},
                             idempotency_key=f"checkout-{cart.pk}",
                             principal={"user": request.user.pk})
    # --8<-- [end:start_run]
    return run
