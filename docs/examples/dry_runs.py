"""docs/fan-out.md, "Dry runs": the plan of the checkout of docs/getting-started.md."""


def print_checkout_plan():
    # --8<-- [start:dry_run]
    from k2b_workflows import dry_run

    report = dry_run("shop.checkout", {"sku": "TEA-01", "amount": 2900}, principal={"user": 7})
    for step in report.steps:               # each with seq, action, summary, output, cost
        print(step.seq, step.action, step.summary, step.cost)
    print(report.cost, report.within_budget)  # totals, and whether they fit the budget
    print(report.errors)                    # e.g. a plan() output without "planned": True
    # --8<-- [end:dry_run]
    return report
