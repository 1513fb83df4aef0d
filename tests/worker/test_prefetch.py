"""How far ahead a worker claims: ``CLAIM_PREFETCH`` on a short queue, more on a backlog
of short runs, never more than ``prefetch.HORIZON_S`` of its threads' work."""

from __future__ import annotations

import pytest

from k2b_workflows.worker.prefetch import HORIZON_S, MAX_AHEAD, Prefetch


def full_claims(prefetch: Prefetch, count: int) -> list[int]:
    seen = []
    for _ in range(count):
        prefetch.claimed(asked=prefetch.current + 2, got=prefetch.current + 2)
        seen.append(prefetch.current)
    return seen


def test_before_any_run_has_ended_it_stays_at_the_floor():
    prefetch = Prefetch(4, concurrency=2)
    assert full_claims(prefetch, 3) == [4, 4, 4]


def test_full_claims_of_short_runs_double_it_up_to_the_horizon():
    prefetch = Prefetch(4, concurrency=2)
    prefetch.ran(0.01)  # 10 ms a run, two threads: 20 runs in the 100 ms horizon
    assert int(HORIZON_S * 2 / 0.01) == 20
    assert full_claims(prefetch, 4) == [8, 16, 20, 20]


def test_a_short_claim_sets_it_back_to_the_floor():
    prefetch = Prefetch(4, concurrency=2)
    prefetch.ran(0.001)
    full_claims(prefetch, 3)
    assert prefetch.current == 32
    prefetch.claimed(asked=34, got=5)  # the backlog is gone
    assert prefetch.current == 4


def test_runs_of_a_second_are_never_taken_ahead_beyond_the_floor():
    prefetch = Prefetch(4, concurrency=8)
    prefetch.ran(1.0)
    assert full_claims(prefetch, 5) == [4] * 5


def test_however_short_the_runs_it_stops_at_the_maximum():
    prefetch = Prefetch(4, concurrency=16)
    prefetch.ran(0.0001)
    assert full_claims(prefetch, 10)[-1] == MAX_AHEAD


def test_no_prefetch_configured_stays_none():
    prefetch = Prefetch(0, concurrency=2)
    prefetch.ran(0.001)
    assert full_claims(prefetch, 3) == [0, 0, 0]


def test_the_mean_follows_the_runs_as_they_get_longer():
    prefetch = Prefetch(2, concurrency=2)
    prefetch.ran(0.001)
    full_claims(prefetch, 8)
    assert prefetch.current == MAX_AHEAD
    for _ in range(40):  # the workload changed: half-second runs
        prefetch.ran(0.5)
    prefetch.claimed(asked=MAX_AHEAD + 2, got=MAX_AHEAD + 2)
    assert prefetch.current == 2


@pytest.mark.django_db(transaction=True)
def test_a_worker_draining_a_backlog_of_short_runs_claims_further_ahead(monkeypatch):
    from k2b_workflows import start_workflow_run
    from k2b_workflows.worker import prefetch
    from k2b_workflows.worker.loop import Worker
    from tests.support.kernel import fresh

    # "Short" is against the horizon: on a loaded machine a run of test.pure takes tens
    # of milliseconds, which a 0.1 s horizon no longer counts as short for 2 threads.
    monkeypatch.setattr(prefetch, "HORIZON_S", 5.0)
    runs = [start_workflow_run("test.pure", {"a": i, "b": 1}) for i in range(120)]
    worker = Worker(concurrency=2, listen=False, burst=True)
    floor = worker.prefetch.floor
    asked: list[int] = []
    claim = worker.claim

    def recording(limit: int, **kwargs):
        asked.append(limit)
        return claim(limit, **kwargs)

    worker.claim = recording  # type: ignore[method-assign]
    worker.run()
    assert {fresh(run).status for run in runs} == {"succeeded"}
    assert asked[0] == worker.concurrency + floor
    assert max(asked) > worker.concurrency + floor, asked
    assert len(asked) < len(runs) / (floor - 1), asked  # fewer claims than at the floor
