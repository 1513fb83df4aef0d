"""A worker is ready before its first claim: its metrics exist and every pool
thread has its connection."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_worker_is_ready_before_its_first_claim(monkeypatch):
    """The metrics exist and every pool thread has its connection before a run needs
    them: the first run of each thread used to pay for both (prometheus_client's
    import, with the import lock and the GIL held, and a new connection)."""
    import threading

    from django.db.backends.signals import connection_created

    from k2b_workflows import metrics
    from k2b_workflows.worker.loop import Worker

    events: list[str] = []
    monkeypatch.setattr(metrics, "prepare", lambda: events.append("metrics"))

    def created(sender, connection, **kwargs):
        events.append(f"connection {threading.current_thread().name}")

    worker = Worker(app_ids=["hot"], concurrency=3, listen=False, burst=True)
    claim = worker.claim

    def claiming(limit: int, **kwargs):
        events.append("claim")
        return claim(limit, **kwargs)

    worker.claim = claiming  # type: ignore[method-assign]
    connection_created.connect(created)
    try:
        worker.run()  # nothing to run: no run ever opens a thread's connection
    finally:
        connection_created.disconnect(created)
    assert "claim" in events and events.index("metrics") < events.index("claim"), events
    pool = {e for e in events if e.startswith("connection k2b-worker")}
    assert len(pool) == worker.concurrency, events


def test_metrics_prepare_creates_the_metrics():
    from k2b_workflows import counters, metrics

    if not metrics.AVAILABLE:
        pytest.skip("prometheus_client is not installed")
    metrics.prepare()
    assert {"steps", "step_seconds", "transitions"} <= set(counters._metrics)
