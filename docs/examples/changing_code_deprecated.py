"""docs/changing-code.md, "Patches": the patch deprecated once no old run is left."""

from k2b_workflows import workflow

from .changing_code_actions import ChargeCard, CreateOrder, ReserveStock


# --8<-- [start:deprecated]
@workflow("shop.checkout", version=1)
def checkout(run, input):
    order = run.step(CreateOrder, input)
    run.deprecate_patch("reserve-stock")  # consumes the marker where a run has one
    run.step(ReserveStock, {"order": order["id"]})
    run.step(ChargeCard, {"order": order["id"]})
    return {"order": order["id"]}
# --8<-- [end:deprecated]
