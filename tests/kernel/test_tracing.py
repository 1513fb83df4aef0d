"""Traces follow a run across worker processes and a SIGKILL, and carry no payload.

The test process plays the caller: it starts runs under a span context of its
own (no SDK here, so the rest of the suite is not traced). Worker processes
run with the OpenTelemetry SDK exporting every span to a file
(``tests/support/otel.py``), as a deployment would configure it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from k2b_workflows import start_workflow_run, tracing, wake_workflow_runs_waiting_on
from k2b_workflows.models import WorkflowRun
from tests.models import DomainRow, ProviderCall
from tests.support.kernel import SETTLED, describe, fresh
from tests.support.otel import read_spans
from tests.support.processes import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 90
CALLER_TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CALLER_SPAN = 0x00F067AA0BA902B7
STEP_ATTRIBUTES = {
    "k2b.run_id",
    "k2b.workflow",
    "k2b.version",
    "k2b.step",
    "k2b.action",
    "k2b.effect",
    "k2b.generation",
    "k2b.outcome",
}


def as_caller():
    """The caller's span is current: a request handled under trace ``CALLER_TRACE``."""
    caller = SpanContext(
        CALLER_TRACE, CALLER_SPAN, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED)
    )
    return trace.use_span(NonRecordingSpan(caller), end_on_exit=False)


def hex_id(value: int, width: int) -> str:
    return f"0x{value:0{width}x}"


def test_a_run_started_under_a_span_stores_the_callers_w3c_context():
    with as_caller():
        run = start_workflow_run("tracing.three_steps", {"marker": "m"})
    stored = WorkflowRun.objects.get(pk=run.pk).trace_context
    assert stored == {"traceparent": f"00-{CALLER_TRACE:032x}-{CALLER_SPAN:016x}-01"}
    outside = start_workflow_run("tracing.three_steps", {"marker": "n"})
    assert WorkflowRun.objects.get(pk=outside.pk).trace_context is None


@pytest.mark.crash
def test_a_run_killed_mid_step_is_one_trace_across_both_workers_linked_to_the_dead_attempt(
    start_worker, wait, tmp_path
):
    with as_caller():
        run = start_workflow_run(
            "tracing.three_steps",
            {"marker": "IN-SECRET-7f3a", "crash": "tracing_send", "gate": "gate-IN-SECRET"},
        )
    first_file, second_file = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first = start_worker(
        "--concurrency",
        "1",
        env={"K2B_TEST_OTEL_FILE": str(first_file), "K2B_TEST_CRASH": "tracing_send"},
    )
    assert first.wait(timeout=TIMEOUT) == -signal.SIGKILL, first.output()
    second = start_worker("--concurrency", "1", env={"K2B_TEST_OTEL_FILE": str(second_file)})
    wait(
        lambda: fresh(run).status == "waiting",
        timeout=TIMEOUT,
        message=lambda: f"the run to park at its gate\n{second.report()}",
    )
    with as_caller():
        DomainRow.objects.create(key="gate-IN-SECRET", value=1)
        assert wake_workflow_runs_waiting_on(app_id="tests", kind="gate", key="gate-IN-SECRET")
    wait(
        lambda: fresh(run).status in SETTLED,
        timeout=TIMEOUT,
        message=lambda: f"run {run.pk} to settle\n{second.report()}",
    )
    assert fresh(run).status == "succeeded", describe(run)
    second.signal(signal.SIGTERM)
    assert second.wait(timeout=TIMEOUT) == 0, second.output()

    spans = read_spans(first_file, second_file)
    raw = first_file.read_text() + second_file.read_text()
    # One trace: the caller's, in both processes.
    assert {s["context"]["trace_id"] for s in spans} == {hex_id(CALLER_TRACE, 32)}
    dead = [s for s in spans if s["file"] == "first.jsonl"]
    alive = [s for s in spans if s["file"] == "second.jsonl"]
    # The killed attempt's run span never ended; its finished step 0 did, under it.
    assert [(s["name"], s["attributes"]["k2b.step"]) for s in dead] == [("k2b.step", 0)]
    dead_run_span = dead[0]["parent_id"]
    assert dead[0]["attributes"]["k2b.outcome"] == "succeeded"

    runs = [s for s in alive if s["name"] == "k2b.run"]
    assert len(runs) == 2  # the takeover (parks at the gate) and the resumption after the wake
    assert all(s["parent_id"] == hex_id(CALLER_SPAN, 16) for s in runs)
    takeover, resumed = sorted(runs, key=lambda s: s["attributes"]["k2b.generation"])
    (link,) = takeover["links"]
    assert link["context"]["span_id"] == dead_run_span
    assert link["attributes"]["k2b.link"] == "lease_expired"
    assert takeover["attributes"]["k2b.outcome"] == "waiting"
    assert resumed["links"][0]["context"]["span_id"] == takeover["context"]["span_id"]
    assert resumed["links"][0]["attributes"]["k2b.link"] == "previous_attempt"
    assert resumed["attributes"]["k2b.outcome"] == "succeeded"

    steps = [s for s in alive if s["name"] == "k2b.step"]
    # Step 0 was replayed in the second worker: not a span. Step 2 ran twice (it parked).
    assert sorted((s["attributes"]["k2b.step"], s["attributes"]["k2b.outcome"]) for s in steps) == [
        (1, "succeeded"),
        (2, "succeeded"),
        (2, "waiting"),
    ]
    for step in steps + dead:
        assert set(step["attributes"]) >= STEP_ATTRIBUTES, step["attributes"]
        assert step["attributes"]["k2b.run_id"] == str(run.pk)
        assert step["attributes"]["k2b.workflow"] == "tracing.three_steps"
    send = next(s for s in steps if s["attributes"]["k2b.step"] == 1)
    assert send["attributes"]["k2b.action"] == "tracing.send"
    assert send["attributes"]["k2b.effect"] == "idempotent"
    assert send["parent_id"] == takeover["context"]["span_id"]
    parked = next(s for s in steps if s["attributes"]["k2b.outcome"] == "waiting")
    assert [e["name"] for e in parked["events"]][:1] == ["k2b.wait"]
    assert parked["events"][0]["attributes"]["k2b.wait.kind"] == "gate"
    # Generations: the dead attempt's, then two more.
    assert {s["attributes"]["k2b.generation"] for s in runs} == {
        dead[0]["attributes"]["k2b.generation"] + 1,
        dead[0]["attributes"]["k2b.generation"] + 2,
    }

    # No input, output, effect key or wait key in any span.
    effect_keys = set(ProviderCall.objects.values_list("effect_key", flat=True))
    assert effect_keys
    for secret in ("IN-SECRET", "OUT-SECRET", *effect_keys):
        assert secret not in raw, secret


def test_a_recorded_decision_is_a_span_in_the_runs_trace_without_evidence_or_actor(tmp_path):
    """``workflowrun resolve`` in a process with the SDK: a k2b.resolve span in the run's trace."""
    from django.contrib.auth.models import Permission, User

    from k2b_workflows.testing import run_until_idle

    with as_caller():
        run = start_workflow_run("kernel.blind_once", {})
    run_until_idle()
    assert fresh(run).status == "needs_attention"
    user = User.objects.create_user("op-IN-SECRET", password="x")
    user.user_permissions.add(Permission.objects.get(codename="resolve_effect"))
    path = tmp_path / "cli.jsonl"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "K2B_TEST_DB_NAME": connection.settings_dict["NAME"],
        "K2B_TEST_OTEL_FILE": str(path),
    }
    args = ["resolve", str(run.pk), "--decision", "absent", "--actor", user.username]
    done = subprocess.run(
        [sys.executable, "manage.py", "workflowrun", *args, "--evidence", "EVIDENCE-SECRET"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    (span,) = read_spans(path)
    assert span["name"] == "k2b.resolve"
    assert span["context"]["trace_id"] == hex_id(CALLER_TRACE, 32)
    assert span["attributes"]["k2b.decision"] == "effect_absent"
    assert "EVIDENCE-SECRET" not in path.read_text() and "IN-SECRET" not in path.read_text()


def test_without_opentelemetry_a_run_is_executed_and_tracing_is_off():
    """A process where ``import opentelemetry`` fails: ENABLED is False and runs still run."""
    with as_caller():
        run = start_workflow_run("tracing.three_steps", {"marker": "m"})
    script = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "import django; django.setup()\n"
        "from k2b_workflows import tracing; assert not tracing.ENABLED, 'otel imported'\n"
        "from django.core.management import call_command\n"
        "call_command('runworkflows', '--burst', '--concurrency', '1')\n"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "K2B_TEST_DB_NAME": connection.settings_dict["NAME"],
    }
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert fresh(run).status == "succeeded", describe(run)
    assert fresh(run).trace_context == {
        "traceparent": f"00-{CALLER_TRACE:032x}-{CALLER_SPAN:016x}-01"
    }


def test_without_a_recording_sdk_nothing_is_written_at_the_claim():
    """With the API but no SDK (this process), the attempt's context is not stored."""
    from k2b_workflows.testing import run_until_idle

    assert tracing.ENABLED
    with as_caller():
        run = start_workflow_run("tracing.three_steps", {"marker": "m"})
    run_until_idle()
    assert fresh(run).status == "succeeded"
    assert set(fresh(run).trace_context) == {"traceparent"}
    out = StringIO()
    call_command("workflowrun", "show", str(run.pk), "--json", stdout=out)
    assert "traceparent" not in json.loads(out.getvalue())["run"]


def test_children_stay_in_the_callers_trace():
    from k2b_workflows.testing import run_until_idle

    with as_caller():
        parent = start_workflow_run("fanout.parent", {"items": [{"value": 1}, {"value": 2}]})
    run_until_idle()
    assert fresh(parent).status == "succeeded", describe(parent)
    children = WorkflowRun.objects.filter(parent=parent)
    assert children.count() == 2
    for child in children:
        assert child.trace_context == {
            "traceparent": f"00-{CALLER_TRACE:032x}-{CALLER_SPAN:016x}-01"
        }


@pytest.mark.crash
def test_a_run_started_outside_any_trace_keeps_one_trace_across_its_claims(
    start_worker, wait, tmp_path
):
    run = start_workflow_run("tracing.three_steps", {"marker": "m", "gate": "gate-2"})
    path = tmp_path / "spans.jsonl"
    worker = start_worker("--concurrency", "1", env={"K2B_TEST_OTEL_FILE": str(path)})
    wait(
        lambda: fresh(run).status == "waiting",
        timeout=TIMEOUT,
        message=lambda: f"the run to park\n{worker.report()}",
    )
    DomainRow.objects.create(key="gate-2", value=1)
    wake_workflow_runs_waiting_on(app_id="tests", kind="gate", key="gate-2")
    wait(
        lambda: fresh(run).status in SETTLED,
        timeout=TIMEOUT,
        message=lambda: f"run {run.pk} to settle\n{worker.report()}",
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()
    spans = read_spans(path)
    first, second = sorted(
        (s for s in spans if s["name"] == "k2b.run"),
        key=lambda s: s["attributes"]["k2b.generation"],
    )
    assert first["parent_id"] is None  # a trace of its own
    assert {s["context"]["trace_id"] for s in spans} == {first["context"]["trace_id"]}
    assert second["parent_id"] == first["context"]["span_id"]
    assert second["links"][0]["attributes"]["k2b.link"] == "previous_attempt"


def _traced_process(path: Path, *args: str) -> subprocess.CompletedProcess:
    """``args`` in a process exporting its spans to ``path`` (the SDK as tests/support/otel.py
    sets it)."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "K2B_TEST_DB_NAME": connection.settings_dict["NAME"],
        "K2B_TEST_OTEL_FILE": str(path),
        "PYTHONPATH": str(ROOT),
    }
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_a_reconcile_answer_is_an_event_on_the_step_that_asked(tmp_path):
    with as_caller():
        run = start_workflow_run("test.charge", {"behaviour": "ambiguous", "amount": 5})
    path = tmp_path / "spans.jsonl"
    done = _traced_process(path, "manage.py", "runworkflows", "--burst", "--concurrency", "1")
    assert done.returncode == 0, done.stderr
    assert fresh(run).status == "succeeded", describe(run)
    steps = [s for s in read_spans(path) if s["name"] == "k2b.step"]
    events = [e for s in steps for e in s["events"] if e["name"] == "k2b.reconcile"]
    assert [e["attributes"]["k2b.reconcile.answer"] for e in events] == ["succeeded"]
    # The answer was lost, reconcile() found the charge: one step, succeeded.
    assert [s["attributes"]["k2b.outcome"] for s in steps] == ["succeeded"]


def test_a_wake_is_an_event_on_the_callers_span_without_the_key(tmp_path):
    run = start_workflow_run("test.wait", {"key": "order-IN-SECRET"})
    from k2b_workflows.testing import run_until_idle

    run_until_idle()
    assert fresh(run).status == "waiting"
    path = tmp_path / "spans.jsonl"
    script = (
        "import django; django.setup()\n"
        "from opentelemetry import trace\n"
        "from k2b_workflows import wake_workflow_runs_waiting_on\n"
        "with trace.get_tracer('caller').start_as_current_span('POST /webhook'):\n"
        "    wake_workflow_runs_waiting_on(app_id='tests', kind='signal', key='order-IN-SECRET')\n"
    )
    done = _traced_process(path, "-c", script)
    assert done.returncode == 0, done.stderr
    (caller,) = read_spans(path)
    (event,) = caller["events"]
    assert event["name"] == "k2b.wake"
    assert event["attributes"] == {"k2b.app_id": "tests", "k2b.wait.kind": "signal", "k2b.woken": 1}
    assert "IN-SECRET" not in path.read_text()
    assert fresh(run).status == "queued"
