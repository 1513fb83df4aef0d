"""Liveness file, Prometheus metrics and structured state-change logs, on real workers."""

from __future__ import annotations

import io
import logging
import re
import signal
import urllib.request

import pytest
from django.core.management import call_command
from django.test import RequestFactory
from prometheus_client.parser import text_string_to_metric_families

from k2b_workflows import counters, fleet, metrics, start_workflow_run
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall
from tests.support.kernel import fresh

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 90


def health(path, max_age: float) -> int:
    try:
        call_command(
            "workerhealth", str(path), "--max-age", str(max_age), stdout=io.StringIO(),
            stderr=io.StringIO(),
        )  # fmt: skip
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_the_health_file_is_fresh_while_the_loop_runs_and_stale_when_it_stops(
    start_worker, wait, tmp_path
):
    path = tmp_path / "worker.health"
    assert health(path, 30) == 1, "no file: unhealthy"
    worker = start_worker("--concurrency", "1", "--health-file", str(path))
    wait(path.exists, timeout=TIMEOUT, message=lambda: f"the health file\n{worker.report()}")
    assert health(path, 30) == 0
    first = path.stat().st_mtime
    wait(lambda: path.stat().st_mtime > first, timeout=TIMEOUT, message="a second touch")

    worker.signal(signal.SIGSTOP)  # a frozen loop stops touching
    try:
        wait(lambda: health(path, 1.5) == 1, timeout=TIMEOUT, message="the file to go stale")
    finally:
        worker.signal(signal.SIGCONT)
    wait(lambda: health(path, 1.5) == 0, timeout=TIMEOUT, message="healthy again after SIGCONT")

    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()
    assert not path.exists(), "a stopped worker must not look healthy"
    assert health(path, 30) == 1


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def metrics_port(worker, wait) -> int:
    found = wait(
        lambda: re.search(r"metrics on port (\d+)", worker.output()),
        timeout=TIMEOUT,
        message="the metrics port in the worker's log",
    )
    return int(found.group(1))


def test_the_worker_serves_prometheus_metrics(start_worker, wait):
    # A lease takeover first: a worker dies holding a run; the metrics worker reaps it.
    slow = start_workflow_run("kernel.slow", {"seconds": 3})
    doomed = start_worker("--concurrency", "1")
    wait(
        lambda: ProviderCall.objects.filter(action="kernel.slow").exists(),
        timeout=TIMEOUT,
        message=lambda: f"the slow step to start\n{doomed.report()}",
    )
    doomed.signal(signal.SIGKILL)
    doomed.wait()

    pure = [start_workflow_run("test.pure", {"a": i, "b": 1}) for i in range(3)]
    doubted = start_workflow_run("test.charge", {"amount": 5, "behaviour": "ambiguous"})
    worker = start_worker("--concurrency", "2", "--metrics-port", "0")
    port = metrics_port(worker, wait)
    runs = [slow, *pure, doubted]
    wait(
        lambda: all(fresh(r).status == "succeeded" for r in runs),
        timeout=TIMEOUT,
        message=lambda: f"every run to succeed\n{worker.report()}",
    )
    # The runs may end before the killed worker's heartbeat is old enough to count as lost.
    wait(
        lambda: len(fleet.live_workers()) == 1,
        timeout=TIMEOUT,
        message="the killed worker to count as lost",
    )

    # The killed worker counts as live until its heartbeat is WORKER_LOST_AFTER_MS old.
    wait(
        lambda: [w["pid"] for w in fleet.live_workers()] == [worker.pid],
        timeout=TIMEOUT,
        message="the killed worker's heartbeat to age past the lost timeout",
    )
    m = scrape(port)
    assert m[("k2b_database_up", ())] == 1
    assert m[("k2b_runs", (("status", "succeeded"),))] == 5
    assert m[("k2b_runs", (("status", "queued"),))] == 0
    assert m[("k2b_queue_depth", ())] == 0
    assert m[("k2b_oldest_queued_age_seconds", ())] == 0
    assert m[("k2b_open_incidents", ())] == 0
    assert m[("k2b_live_workers", ())] == 1  # the killed one is not counted
    assert m[("k2b_lease_takeovers_total", ())] >= 1
    assert m[("k2b_run_transitions_total", (("status", "succeeded"),))] == 5
    # test.pure: 2 steps each; kernel.slow: 2 after the takeover (the first was never journaled).
    assert m[("k2b_steps_total", (("effect", "pure"), ("outcome", "succeeded")))] == 8
    assert m[("k2b_step_duration_seconds_count", (("effect", "pure"),))] == 8
    assert m[("k2b_steps_total", (("effect", "external"), ("outcome", "outcome_unknown")))] == 1
    assert m[("k2b_steps_total", (("effect", "external"), ("outcome", "succeeded")))] == 1
    assert m[("k2b_reconcile_answers_total", (("answer", "succeeded"),))] == 1


def test_the_django_view_reads_the_gauges_from_the_database():
    start_workflow_run("test.pure", {"a": 1, "b": 1})
    start_workflow_run("test.pure", {"a": 2, "b": 1})
    response = metrics.metrics_view(RequestFactory().get("/metrics"))
    assert response.status_code == 200
    text = response.content.decode()
    assert 'k2b_runs{status="queued"} 2.0' in text
    assert "k2b_queue_depth 2.0" in text
    assert "k2b_live_workers 0.0" in text


def test_without_prometheus_client_the_view_says_what_to_install(monkeypatch):
    monkeypatch.setattr(metrics, "AVAILABLE", False)
    monkeypatch.setattr(counters, "AVAILABLE", False)
    metrics.count_step("pure", "succeeded", 0.1)  # a no-op, never an error
    response = metrics.metrics_view(RequestFactory().get("/metrics"))
    assert response.status_code == 501
    assert b"k2b-workflows[metrics]" in response.content
    with pytest.raises(RuntimeError, match="prometheus_client"):
        metrics.serve(0)


def test_every_state_change_is_logged_with_structured_fields(caplog):
    run = start_workflow_run("test.charge", {"amount": 5, "behaviour": "ambiguous"})
    with caplog.at_level(logging.INFO, logger="k2b_workflows.events"):
        run_until_idle()
    assert fresh(run).status == "succeeded"
    events = [r for r in caplog.records if r.name == "k2b_workflows.events"]
    for record in events:
        assert record.run_id == str(run.pk)
        assert record.workflow == "test.charge"
        assert record.generation >= 1
        assert hasattr(record, "step") and hasattr(record, "effect_key")
    by_event = {r.event: r for r in events}
    assert list(by_event) == [
        "claimed",
        "effect_dispatched",
        "effect_outcome_unknown",
        "reconcile",
        "effect_reconciled",
        "step_succeeded",
        "run_succeeded",
    ]
    for name in ("effect_dispatched", "effect_outcome_unknown", "step_succeeded"):
        assert by_event[name].step == 0
        assert by_event[name].effect_key == f"{run.pk}:0"
    assert by_event["effect_outcome_unknown"].levelno == logging.WARNING
    assert by_event["reconcile"].answer == "succeeded"


def test_a_broken_metric_never_changes_a_runs_outcome(monkeypatch):
    def broken(name):
        raise ValueError("Duplicated timeseries")  # what racing first uses once raised

    monkeypatch.setattr(counters, "_get", broken)
    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    stats = run_until_idle()
    assert fresh(run).status == "succeeded"
    assert stats["retry"] == 0 and fresh(run).consecutive_failures == 0
