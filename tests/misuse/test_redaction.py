"""No secrets on screen or in stored and logged error texts (#9).

Redaction of JSON values and texts on their own, then the kernel's stored and
logged exception texts, then every admin screen that shows run data.
"""

from __future__ import annotations

import logging
from html import unescape

import pytest
from django.urls import reverse

from k2b_workflows import EFFECT_CONFIRMED, start_workflow_run
from k2b_workflows.models import JournalEntry, LedgerEntry, WorkflowRun
from k2b_workflows.redaction import (
    CARD_REDACTED,
    REDACTED,
    redact,
    redact_text,
    scrub_error,
)
from k2b_workflows.testing import run_until_idle
from tests.support.admin import client_for, make_user, resolve_url, run_url
from tests.workflows.secrets import LEAKY_URL

SECRETS = ("hunter2", "sk_live_SECRET", "tok_LIVE", "4242424242424242", "4242 4242 4242 4242")


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} shown"


# -- the functions -------------------------------------------------------------------


def test_sensitive_keys_are_redacted_case_insensitively_and_by_substring():
    value = {
        "Password": "p",
        "card_token": "t",
        "X-Api-Key": "k",
        "apiKey": "k",
        "Authorization": "Bearer abc",
        "nested": [{"client_secret": "s"}],
        "pan": "4111",
        "company": "ACME",
        "shipping": "fast",
    }
    shown = redact(value)
    assert shown == {
        "Password": REDACTED,
        "card_token": REDACTED,
        "X-Api-Key": REDACTED,
        "apiKey": REDACTED,
        "Authorization": REDACTED,
        "nested": [{"client_secret": REDACTED}],
        "pan": REDACTED,  # exact key: "company" and "shipping" stay readable
        "company": "ACME",
        "shipping": "fast",
    }
    assert value["Password"] == "p", "redact() must not change its argument"


def test_card_numbers_are_redacted_wherever_they_are_but_other_numbers_stay():
    shown = redact({"note": "paid with 4242 4242 4242 4242", "n": 4242424242424242, "id": 1234})
    assert shown == {"note": f"paid with {CARD_REDACTED}", "n": CARD_REDACTED, "id": 1234}
    # Not Luhn-valid: an order number, not a card.
    assert redact_text("order 1234567890123") == "order 1234567890123"


def test_credentials_in_urls_query_strings_and_headers_are_scrubbed():
    text = scrub_error(f"GET {LEAKY_URL} failed; Authorization: Bearer abcdef123456 token=xyz")
    assert "hunter2" not in text and "sk_live_SECRET" not in text
    assert "abcdef123456" not in text and "xyz" not in text
    assert "api.example.com/v1/charges" in text and "amount=5" in text


QUERY_SECRETS = [
    "https://api.example/charge?api_key=sk_live_X",
    "https://api.example/charge?amount=5&token=sk_live_X",
    "https://api.example/login?user=ann&password=sk_live_X#top",
    "https://api.example/me?access_token=sk_live_X;v=2",
]


@pytest.mark.parametrize("url", QUERY_SECRETS)
def test_credentials_in_a_query_string_without_userinfo_are_scrubbed(url):
    text = scrub_error(f"POST {url} timed out")
    assert "sk_live_X" not in text and "[redacted]]" not in text
    assert "api.example/" in text and text.endswith("timed out")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("url", QUERY_SECRETS)
def test_query_string_credentials_never_reach_the_ledger_or_the_logs(url, caplog):
    run = start_workflow_run("secrets.leaky_charge", {"url": url})
    with caplog.at_level(logging.INFO, logger="k2b_workflows"):
        run_until_idle()
    messages = list(LedgerEntry.objects.filter(run=run).values_list("message", flat=True))
    assert any("api.example/" in m for m in messages)
    logged = "\n".join(
        [r.getMessage() for r in caplog.records] + [r.exc_text or "" for r in caplog.records]
    )
    for text in [*messages, WorkflowRun.objects.get(pk=run.pk).error_message, logged]:
        assert "sk_live_X" not in text


def test_error_texts_are_truncated_to_the_configured_length(settings):
    settings.K2B_WORKFLOWS = {**settings.K2B_WORKFLOWS, "ERROR_TEXT_MAX_CHARS": 50}
    text = scrub_error("x" * 200)
    assert text.startswith("x" * 50) and "150 more characters truncated" in text
    assert len(text) < 100


def hide_emails(value):
    """A user hook: redacts e-mail addresses as well."""
    if isinstance(value, dict):
        return {k: "[email]" if k == "email" else hide_emails(v) for k, v in value.items()}
    return value


def test_a_user_hook_redacts_more(settings):
    settings.K2B_WORKFLOWS = {
        **settings.K2B_WORKFLOWS,
        "REDACT_HOOK": "tests.misuse.test_redaction.hide_emails",
    }
    assert redact({"email": "a@b.c", "password": "p"}) == {"email": "[email]", "password": REDACTED}


# -- what the kernel stores and logs -------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_exception_texts_are_scrubbed_in_error_message_and_logs(caplog, settings):
    settings.K2B_WORKFLOWS = {**settings.K2B_WORKFLOWS, "RUN_MAX_CONSECUTIVE_FAILURES": 1}
    run = start_workflow_run("secrets.leaky_failure", {})
    with caplog.at_level(logging.INFO, logger="k2b_workflows"):
        run_until_idle()
    run.refresh_from_db()
    assert run.status == "failed"
    assert "api.example.com" in run.error_message
    assert_no_secret(run.error_message)
    logged = "\n".join(
        [r.getMessage() for r in caplog.records] + [r.exc_text or "" for r in caplog.records]
    )
    assert "api.example.com" in logged
    assert_no_secret(logged)


@pytest.mark.django_db(transaction=True)
def test_stored_exception_texts_are_truncated(settings):
    settings.K2B_WORKFLOWS = {
        **settings.K2B_WORKFLOWS,
        "RUN_MAX_CONSECUTIVE_FAILURES": 1,
        "ERROR_TEXT_MAX_CHARS": 300,
    }
    run = start_workflow_run("secrets.leaky_failure", {"pad": 10_000})
    run_until_idle()
    run.refresh_from_db()
    assert len(run.error_message) < 500 and "truncated" in run.error_message


@pytest.mark.django_db(transaction=True)
def test_ledger_messages_after_a_failed_dispatch_are_scrubbed():
    run = start_workflow_run("secrets.leaky_charge", {})
    run_until_idle()
    run.refresh_from_db()
    assert run.status == "needs_attention"
    messages = list(LedgerEntry.objects.filter(run=run).values_list("message", flat=True))
    assert any("api.example.com" in m for m in messages)
    for message in messages:
        assert_no_secret(message)


# -- what the admin shows ------------------------------------------------------------------


@pytest.fixture
def viewer():
    return make_user("victor", "view_workflowrun", "view_journalentry", "view_ledgerentry")


@pytest.mark.django_db(transaction=True)
def test_run_page_redacts_input_output_idempotency_key_and_error(viewer):
    run = start_workflow_run(
        "secrets.tokenize",
        {"user": "ann", "password": "hunter2", "card": {"number": "4242424242424242"}},
        idempotency_key="signup-token=tok_LIVE_key",
    )
    run_until_idle()
    WorkflowRun.objects.filter(pk=run.pk).update(error_message=f"earlier: {LEAKY_URL}")
    html = unescape(client_for(viewer).get(run_url(run)).content.decode())
    assert_no_secret(html)
    assert '"user": "ann"' in html and '"last4": "4242"' in html
    assert REDACTED in html and "signup-token=" in html and "api.example.com" in html


@pytest.mark.django_db(transaction=True)
def test_journal_and_ledger_pages_redact_outputs_details_and_messages(viewer):
    run = start_workflow_run("secrets.tokenize", {})
    run_until_idle()
    entry = JournalEntry.objects.get(run=run)
    url = reverse("admin:k2b_workflows_journalentry_change", args=[entry.pk])
    html = unescape(client_for(viewer).get(url).content.decode())
    assert '"last4": "4242"' in html
    assert_no_secret(html)

    leaky = start_workflow_run("secrets.leaky_charge", {})
    run_until_idle()
    for ledger_entry in LedgerEntry.objects.filter(run=leaky):
        url = reverse("admin:k2b_workflows_ledgerentry_change", args=[ledger_entry.pk])
        response = client_for(viewer).get(url)
        assert response.status_code == 200
        assert_no_secret(unescape(response.content.decode()))


@pytest.mark.django_db(transaction=True)
def test_incident_queue_and_resolution_page_redact_messages():
    operator = make_user("olga", "view_workflowrun", "resolve_effect")
    run = start_workflow_run("secrets.leaky_charge", {})
    run_until_idle()
    client = client_for(operator)
    queue = client.get(reverse("admin:k2b_workflows_incident_changelist"))
    resolve = client.get(resolve_url(run))
    for response in (queue, resolve):
        html = unescape(response.content.decode())
        assert "api.example.com" in html
        assert_no_secret(html)
    # The confirmed output an operator types is redacted on the run page afterwards too.
    from k2b_workflows import resolve_effect

    run.refresh_from_db()
    head = LedgerEntry.objects.filter(run=run).order_by("-id").first()
    resolve_effect(
        run.pk,
        EFFECT_CONFIRMED,
        evidence="dashboard",
        actor=operator,
        output={"card_token": "tok_LIVE_x"},
        step=run.attention_step,
        seen_ledger_id=head.pk,
    )
    assert_no_secret(unescape(client.get(run_url(run)).content.decode()))


@pytest.mark.django_db(transaction=True)
def test_dry_run_page_redacts_plan_outputs():
    planner = make_user("paula", "view_workflowrun", "dry_run_workflow")
    url = reverse("admin:k2b_workflows_workflowrun_dry_run")
    response = client_for(planner).post(url, {"workflow": "secrets.leaky_charge", "input": "{}"})
    html = unescape(response.content.decode())
    assert '"amount": 5' in html
    assert_no_secret(html)
