"""docs/effects.md, "Recipes": one action per effect class, as the page shows them."""

from django.db.models import F

from k2b_workflows import Action, Effect, failed, succeeded

# --8<-- [start:dedup_imports]
from k2b_workflows.dedup import insert_once
from k2b_workflows.models import DedupRecord

# --8<-- [end:dedup_imports]
from .models import Invoice, Stock
from .providers import gateway, mailer, provider, sms


# --8<-- [start:reserve_stock]
class ReserveStock(Action):
    name = "shop.reserve"
    effect = Effect.TRANSACTIONAL

    def plan(self, ctx, input):
        return succeeded({"planned": True, "reserved": True}, summary=f"Reserve {input['sku']}")

    def run(self, ctx, input):
        Stock.objects.using(ctx.tx.using).filter(sku=input["sku"]).update(free=F("free") - 1)
        return succeeded({"reserved": True})
# --8<-- [end:reserve_stock]


# --8<-- [start:send_receipt]
class SendReceipt(Action):
    name = "shop.send_receipt"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True, "sent": True}, summary=f"Receipt to {input['to']}")

    def run(self, ctx, input):
        mailer.send(to=input["to"], template="receipt", idempotency_key=ctx.effect_key)
        return succeeded({"sent": True})
# --8<-- [end:send_receipt]


class SendSms(Action):
    name = "shop.send_sms"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True, "sent": True}, summary=f"SMS to {input['to']}")

    # --8<-- [start:dedup]
    def run(self, ctx, input):
        _, created = insert_once(DedupRecord, key=ctx.effect_key, name="sms", value=input)
        if created:
            sms.send(input["to"], input["text"])
        return succeeded({"sent": True})
    # --8<-- [end:dedup]


class CreateInvoice(Action):
    name = "shop.create_invoice"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True, "invoice": None}, summary=f"Invoice {input['order']}")

    # --8<-- [start:fenced]
    def run(self, ctx, input):
        result = provider.create_invoice(order=input["order"], idempotency_key=ctx.effect_key)
        with ctx.fenced():                      # transaction.atomic + heartbeat(tx)
            Invoice.objects.create(number=result.number, order_id=input["order"])
        return succeeded({"invoice": result.number})
    # --8<-- [end:fenced]


# --8<-- [start:charge_by_key]
class ChargeByKey(Action):
    name = "shop.charge_by_key"
    effect = Effect.EXTERNAL
    redispatch_when_absent = True      # the gateway deduplicates by idempotency key

    def plan(self, ctx, input):
        return succeeded({"planned": True, "charge_id": None}, summary=f"Charge {input['amount']}")

    def run(self, ctx, input):
        charge = gateway.charge(input["amount"], idempotency_key=ctx.effect_key)
        return succeeded({"charge_id": charge.id})

    def reconcile(self, ctx, input):
        charge = gateway.find(idempotency_key=ctx.effect_key)
        if charge is None:             # absent: dispatch again, under the same key
            return failed("no charge under this key", code="CHARGE_ABSENT", retryable=True)
        return succeeded({"charge_id": charge.id})
# --8<-- [end:charge_by_key]
