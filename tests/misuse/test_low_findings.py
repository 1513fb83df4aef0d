"""The second review's low findings that are fixed in code (#35).

- a no-op ``migrate`` of the live database, in a process that had called
  ``setup_test_environment()``, made it flushable;
- a garbage ``trace_context`` on a run logged a traceback at every claim;
- bare Stripe and AWS credentials were not scrubbed.
"""

from __future__ import annotations

import logging

import pytest
from django.db import connections

from k2b_workflows import start_workflow_run, testdb, tracing
from k2b_workflows.models import WorkflowRun
from k2b_workflows.redaction import REDACTED, redact_text
from k2b_workflows.testing import run_until_idle
from tests.support import runtime_role
from tests.support.runtime_role import RUNTIME, as_runtime

runtime = runtime_role.runtime


def test_a_no_op_migrate_of_the_live_database_does_not_make_it_flushable():
    settings = connections["default"].settings_dict
    saved = settings["NAME"]
    settings["NAME"] = "k2b_live"  # a migrate run on the live database, nothing to apply
    try:
        testdb.record_test_database(None, using="default", plan=[])
        assert not testdb.created_by_test_runner("default")
    finally:
        settings["NAME"] = saved
        testdb._created.discard("k2b_live")


def test_the_test_runners_own_database_is_still_flushable():
    assert testdb.created_by_test_runner("default")


GARBAGE = {
    "a string": '"not a context"',
    "a list": "[1, 2, 3]",
    "wrong types": '{"traceparent": 7, "attempt": "x", "attempt_generation": "2"}',
    "a huge tracestate": None,  # built below: 1 MB
}


@pytest.mark.django_db(transaction=True, databases=["default", RUNTIME])
@pytest.mark.parametrize("garbage", sorted(GARBAGE))
@pytest.mark.parametrize("provider", ["none", "set"])
def test_a_garbage_trace_context_is_ignored_with_one_warning(
    runtime, caplog, monkeypatch, garbage, provider
):
    """With no tracer provider a claim makes no span but still checks the stored context;
    with one ("set": the API's spans stand in for an SDK's here) the span is built from it."""
    if provider == "set":
        monkeypatch.setattr(tracing, "_provider_set", lambda: True)
    value = GARBAGE[garbage]
    if value is None:
        value = '{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",'
        value += f' "tracestate": "k={"x" * 1_000_000}"}}'
    runs = [start_workflow_run("sched.echo", {"scheduled_for": f"tick {n}"}) for n in range(2)]
    for run in runs:
        as_runtime("UPDATE k2b_run SET trace_context = %s::jsonb WHERE id = %s", [value, run.pk])
    caplog.set_level(logging.WARNING)

    run_until_idle(using=RUNTIME)

    assert {r.status for r in WorkflowRun.objects.filter(pk__in=[r.pk for r in runs])} == {
        "succeeded"
    }
    warned = [
        r.getMessage() for r in caplog.records if "not one the kernel wrote" in r.getMessage()
    ]
    assert sorted(m.split()[1].rstrip(":") for m in warned) == sorted(str(r.pk) for r in runs)
    assert not [r for r in caplog.records if r.exc_info]


@pytest.mark.parametrize(
    "secret",
    [
        "sk_live_51HabcdEFGHijklmnopQRST",
        "rk_test_abcdefghij12345",
        "AKIAIOSFODNN7EXAMPLE",
        "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    ],
)
def test_bare_stripe_and_aws_credentials_are_scrubbed(secret):
    assert redact_text(f"provider said: {secret} was refused") == (
        f"provider said: {REDACTED} was refused"
    )


@pytest.mark.parametrize(
    "kept",
    [
        "commit 9ad12da0b5b3cf65d75a940be1e7f6c4aa5b3d1e",  # a lowercase hex digest
        "order ORD-2026-000123 shipped",
        "sk_live_short",
    ],
)
def test_what_only_looks_alike_is_kept(kept):
    assert redact_text(kept) == kept
