"""docs/fan-out.md, "Effect budgets": a workflow that may send at most 100 emails."""

from k2b_workflows import Action, Effect, succeeded, workflow

from .providers import mailer


class SendReport(Action):
    name = "reports.send_report"
    effect = Effect.IDEMPOTENT

    def cost(self, input):
        return {"emails": 1}

    def plan(self, ctx, input):
        return succeeded({"planned": True, "sent": True}, summary=f"Report to {input['to']}")

    def run(self, ctx, input):
        mailer.send(to=input["to"], template="report", idempotency_key=ctx.effect_key)
        return succeeded({"sent": True})


# --8<-- [start:send_all]
@workflow("reports.send_all", app_id="reports", effect_budget={"emails": 100}, max_ai_calls=20)
def send_all(run, input):
    for address in input["to"]:
        run.step(SendReport, {"to": address})   # SendReport.cost() returns {"emails": 1}
# --8<-- [end:send_all]
