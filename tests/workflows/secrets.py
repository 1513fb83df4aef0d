"""Workflows whose values and exception texts carry secrets, for the redaction tests."""

from __future__ import annotations

from k2b_workflows import Action, Effect, succeeded, workflow

#: An exception text as an HTTP client writes it: the URL with its credentials.
LEAKY_URL = "https://shop:hunter2@api.example.com/v1/charges?api_key=sk_live_SECRET&amount=5"


class LeakyFailure(Action):
    """PURE: fails like a careless HTTP client, naming the whole URL."""

    name = "secrets.leaky_failure"
    effect = Effect.PURE

    def run(self, ctx, input):
        raise ConnectionError(f"cannot reach {LEAKY_URL}" + " padding" * input.get("pad", 0))


class LeakyCharge(Action):
    """EXTERNAL: raises after dispatch with the URL in the text, so the outcome is unknown."""

    name = "secrets.leaky_charge"
    effect = Effect.EXTERNAL

    def plan(self, ctx, input):
        return succeeded({"planned": True, "card_token": "tok_LIVE_plan", "amount": 5})

    def run(self, ctx, input):
        raise ConnectionError(f"POST {input.get('url', LEAKY_URL)} timed out")


class Tokenize(Action):
    """PURE: returns what a card vault returns."""

    name = "secrets.tokenize"
    effect = Effect.PURE

    def run(self, ctx, input):
        return succeeded(
            {"card_token": "tok_LIVE_abc", "pan": "4242424242424242", "last4": "4242"},
            summary="token for 4242 4242 4242 4242",
        )


@workflow("secrets.leaky_failure", app_id="tests")
def leaky_failure(run, input):
    return run.step(LeakyFailure, input)


@workflow("secrets.leaky_charge", app_id="tests")
def leaky_charge(run, input):
    return run.step(LeakyCharge, input)


@workflow("secrets.tokenize", app_id="tests")
def tokenize(run, input):
    return run.step(Tokenize, input)
