"""docs/fan-out.md, "AI tasks": a provider the workers run and a step that waits for it."""

# --8<-- [start:ai_task]
from k2b_workflows import Action, Effect, ai_provider, succeeded

from .providers import client


@ai_provider("openai.chat")
def chat(request, abort):           # abort: threading.Event
    return client.chat(request["messages"], timeout=60)


class Summarize(Action):
    name = "support.summarize"
    effect = Effect.IDEMPOTENT

    def plan(self, ctx, input):
        return succeeded({"planned": True}, summary="Summarize with openai.chat")

    def run(self, ctx, input):
        messages = [{"role": "user", "content": f"Summarize: {input['text']}"}]
        return ctx.ai_task("openai.chat", {"messages": messages})
# --8<-- [end:ai_task]
