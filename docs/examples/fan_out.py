"""docs/fan-out.md, "Child runs": a checkout that ships each item in a child run."""

from k2b_workflows import Action, Effect, succeeded, workflow

from .providers import courier


class BookCourier(Action):
    name = "shop.book_courier"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True, "pickup": None}, summary=f"Ship {input['item']}")

    def run(self, ctx, input):
        return succeeded({"pickup": courier.book(input["item"], idempotency_key=ctx.effect_key)})


# --8<-- [start:children]
@workflow("shop.ship_item", app_id="shop")          # the child: a workflow like any other
def ship_item(run, input):
    return run.step(BookCourier, {"item": input["item"]})


@workflow("shop.checkout", app_id="shop", max_steps=200)
def checkout(run, input):
    results = run.children("shop.ship_item", [{"item": i} for i in input["items"]])
    return {"shipped": sum(r.status == "succeeded" for r in results)}
# --8<-- [end:children]
