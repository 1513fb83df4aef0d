"""docs/changing-code.md, "Patches": the same change as version 2, behind a patch."""

from k2b_workflows import workflow

from .changing_code_actions import ChargeCard, CreateOrder, ReserveStock


# --8<-- [start:patched]
@workflow("shop.checkout", version=1)
def checkout(run, input):
    order = run.step(CreateOrder, input)
    if run.patched("reserve-stock"):
        run.step(ReserveStock, {"order": order["id"]})
    run.step(ChargeCard, {"order": order["id"]})
    return {"order": order["id"]}
# --8<-- [end:patched]
