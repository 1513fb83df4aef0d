"""The demo shop's workflows: checkout with a card charge, receipt, approval, shipping fan-out
and an AI summary; and a bank payout whose outcome only a person can settle."""

from __future__ import annotations

import datetime as dt

from k2b_workflows import (
    Action,
    Dependency,
    Effect,
    ai_provider,
    failed,
    succeeded,
    waiting,
    workflow,
)
from k2b_workflows.dedup import insert_once

from .models import Approval, Order, OutboxEmail, Shipment
from .providers import LegacyBank, PaymentGateway, summarize

APPROVAL_LIMIT_CENTS = 50_000

ai_provider("demo.summarizer")(summarize)


# --8<-- [start:create_order]
class CreateOrder(Action):
    """TRANSACTIONAL: the order row commits in the same transaction as the journal entry."""

    name = "shop.create_order"
    effect = Effect.TRANSACTIONAL

    def plan(self, ctx, input):
        return succeeded(
            {"planned": True, "order_id": None, "items": input["items"]},
            summary=f"Create order for {input['sku']}",
        )

    def run(self, ctx, input):
        order = Order.objects.using(ctx.tx.using).create(
            sku=input["sku"],
            items=input["items"],
            amount_cents=input["amount_cents"],
            customer=input["customer"],
        )
        return succeeded({"order_id": order.pk, "items": order.items}, summary=f"order {order.pk}")


# --8<-- [end:create_order]


# --8<-- [start:wait_for_approval]
class WaitForApproval(Action):
    """PURE: large orders wait for a person; small ones pass straight through."""

    name = "shop.wait_for_approval"
    effect = Effect.PURE

    def run(self, ctx, input):
        if input["amount_cents"] < APPROVAL_LIMIT_CENTS:
            return succeeded({"approved_by": "auto"})
        approval = Approval.objects.filter(order_id=input["order_id"]).first()
        if approval is None:
            return waiting(
                Dependency(
                    "approval", f"order-{input['order_id']}", deadline=dt.timedelta(hours=24)
                )
            )
        return succeeded({"approved_by": approval.approved_by})


# --8<-- [end:wait_for_approval]


# --8<-- [start:charge_card]
class ChargeCard(Action):
    """EXTERNAL: recorded as dispatched before the call; reconciled by key after any doubt."""

    name = "shop.charge_card"
    effect = Effect.EXTERNAL
    # The gateway deduplicates by idempotency key: a charge reconciled absent (the
    # worker died between the ledger's "dispatched" and the call) is sent again
    # under the same key, and the card is charged once.
    redispatch_when_absent = True

    def cost(self, input):
        return {"charges": 1}

    def plan(self, ctx, input):
        return succeeded(
            {"planned": True, "charge_id": None},
            summary=f"Charge {input['amount_cents'] / 100:.2f} EUR",
        )

    def run(self, ctx, input):
        charge_id = PaymentGateway().charge(
            idempotency_key=ctx.effect_key,
            amount_cents=input["amount_cents"],
            timeout=input.get("simulate_timeout", False),
        )
        return succeeded({"charge_id": charge_id}, summary=charge_id)

    def reconcile(self, ctx, input):
        charge_id = PaymentGateway().find(ctx.effect_key)
        if charge_id is None:
            return failed(
                "the gateway has no charge under this key", code="CHARGE_NOT_FOUND", retryable=True
            )
        return succeeded({"charge_id": charge_id, "reconciled": True}, summary=charge_id)


# --8<-- [end:charge_card]


# --8<-- [start:send_receipt]
class SendReceipt(Action):
    """IDEMPOTENT: the outbox deduplicates by the step's effect key."""

    name = "shop.send_receipt"
    effect = Effect.IDEMPOTENT

    def cost(self, input):
        return {"emails": 1}

    def plan(self, ctx, input):
        return succeeded({"planned": True}, summary=f"Email receipt to {input['to']}")

    def run(self, ctx, input):
        insert_once(
            OutboxEmail,
            key=ctx.effect_key,
            to=input["to"],
            subject=f"Receipt for order {input['order_id']}",
        )
        return succeeded({"message_key": ctx.effect_key})


# --8<-- [end:send_receipt]


# --8<-- [start:summarize_order]
class SummarizeOrder(Action):
    """Asks the AI provider once per step; the step waits for the durable task."""

    name = "shop.summarize_order"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        # The workflow reads "summary" from this step's output: a plan must have its shape.
        return succeeded(
            {"planned": True, "summary": "(a summary of the order)"},
            summary="Summarize the order with the AI provider",
        )

    def run(self, ctx, input):
        return ctx.ai_task("demo.summarizer", {"text": input["text"]})


# --8<-- [end:summarize_order]


# --8<-- [start:reserve_stock]
class ReserveStock(Action):
    name = "shop.book_courier"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True}, summary=f"Book a courier for {input['item']}")

    def run(self, ctx, input):
        shipment, _ = Shipment.objects.get_or_create(
            key=ctx.effect_key, defaults={"order_id": input["order_id"], "item": input["item"]}
        )
        return succeeded({"shipment": shipment.pk})


# --8<-- [end:reserve_stock]


# --8<-- [start:bank_payout]
class BankPayout(Action):
    """EXTERNAL without reconcile: after a timeout only an operator can tell."""

    name = "shop.bank_payout"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True}, summary=f"Pay out {input['amount_cents']} cents")

    def run(self, ctx, input):
        transfer = LegacyBank().transfer(
            reference=ctx.effect_key, amount_cents=input["amount_cents"]
        )
        return succeeded({"transfer": transfer})


# --8<-- [end:bank_payout]


# --8<-- [start:ship_item]
@workflow("shop.ship_item", app_id="shop")
def ship_item(run, input):
    return run.step(ReserveStock, input)


# --8<-- [end:ship_item]


# --8<-- [start:checkout]
@workflow(
    "shop.checkout",
    app_id="shop",
    effect_budget={"charges": 1, "emails": 3},
    max_ai_calls=2,
    max_steps=50,
)
def checkout(run, input):
    order = run.step(CreateOrder, input)
    approval = run.step(
        WaitForApproval, {"order_id": order["order_id"], "amount_cents": input["amount_cents"]}
    )
    charge = run.step(
        ChargeCard,
        {
            "order_id": order["order_id"],
            "amount_cents": input["amount_cents"],
            "simulate_timeout": input.get("simulate_timeout", False),
        },
    )
    run.step(SendReceipt, {"order_id": order["order_id"], "to": input["customer"]})
    shipped = run.children(
        "shop.ship_item", [{"order_id": order["order_id"], "item": item} for item in order["items"]]
    )
    summary = run.step(
        SummarizeOrder,
        {
            "text": f"Order {order['order_id']} of {input['sku']} "
            f"for {input['customer']}, approved by "
            f"{approval['approved_by']}, items "
            f"{', '.join(order['items'])}."
        },
    )
    return {
        "order_id": order["order_id"],
        "charge_id": charge["charge_id"],
        "shipped": sum(1 for r in shipped if r.status == "succeeded"),
        "summary": summary["summary"],
    }


# --8<-- [end:checkout]


# --8<-- [start:payout]
@workflow("shop.payout", app_id="shop")
def payout(run, input):
    return run.step(BankPayout, input)


# --8<-- [end:payout]
