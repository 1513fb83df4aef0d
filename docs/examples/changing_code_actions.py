"""The actions of docs/changing-code.md's workflows (the page does not show them)."""

from django.db.models import F

from k2b_workflows import Action, Effect, succeeded

from .models import Order, Stock
from .providers import gateway


class CreateOrder(Action):
    name = "shop.create_order"
    effect = Effect.TRANSACTIONAL

    def plan(self, ctx, input):
        return succeeded({"planned": True, "id": None}, summary=f"Order {input['sku']}")

    def run(self, ctx, input):
        return succeeded({"id": Order.objects.using(ctx.tx.using).create(sku=input["sku"]).pk})


class ReserveStock(Action):
    name = "shop.reserve_stock"
    effect = Effect.TRANSACTIONAL

    def plan(self, ctx, input):
        return succeeded({"planned": True, "reserved": True}, summary="Reserve stock")

    def run(self, ctx, input):
        order = Order.objects.using(ctx.tx.using).get(pk=input["order"])
        Stock.objects.using(ctx.tx.using).filter(sku=order.sku).update(free=F("free") - 1)
        return succeeded({"reserved": True})


class ChargeCard(Action):
    """EXTERNAL without reconcile(): after a crash an operator decides."""

    name = "shop.charge_card"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True, "charge_id": None}, summary="Charge the card")

    def run(self, ctx, input):
        return succeeded({"charge_id": gateway.charge(100, idempotency_key=ctx.effect_key).id})
