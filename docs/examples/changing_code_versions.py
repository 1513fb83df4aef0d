"""docs/changing-code.md, "Versions": version 2 registered beside version 1."""

from k2b_workflows import workflow

from .changing_code_actions import ChargeCard, CreateOrder, ReserveStock


# --8<-- [start:versions]
@workflow("shop.checkout", version=1)        # kept until its runs have drained
def checkout_v1(run, input):
    order = run.step(CreateOrder, input)
    run.step(ChargeCard, {"order": order["id"]})
    return {"order": order["id"]}


@workflow("shop.checkout", version=2)        # what new runs start on
def checkout_v2(run, input):
    order = run.step(CreateOrder, input)
    run.step(ReserveStock, {"order": order["id"]})
    run.step(ChargeCard, {"order": order["id"]})
    return {"order": order["id"]}
# --8<-- [end:versions]
