"""Flow control across worker processes: limits that hold through SIGKILL and restarts.

Measured from what the actions themselves recorded (``tests/workflows/flow.py``:
rows each committed on its own as the action starts and ends, and the
provider's own timestamps), never from the kernel's bookkeeping.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import defaultdict
from datetime import UTC, datetime

import pytest
from django.db import connection

from k2b_workflows import start_workflow_run
from k2b_workflows.models import WorkflowRun
from tests.models import ProviderCall
from tests.support.pgcluster import Cluster, django_script, manage
from tests.support.processes import WorkerProcess, wait_for

pytestmark = [pytest.mark.crash, pytest.mark.slow]

TIMEOUT = 240  # a shared 2-core machine: nothing here is a timing assertion but the limits

KEYS, PER_KEY, LIMIT = 6, 12, 2


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end at t closes before a start at t)."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    open_, most = 0, 0
    for _, delta in edges:
        open_ += delta
        most = max(most, open_)
    return most


def spans_by_key(rows: list[tuple[str, int, int, str, str, float]]) -> dict[str, list]:
    """One interval per attempt of the action (overlapping attempts of one step merged):
    from its start row to its end row.

    An attempt without an end row (its worker was killed, or its database went
    away) is counted open until the next attempt of the same step starts, or
    the last row of all: never shorter than it really was.
    """
    starts: dict[tuple, float] = {}
    ends: dict[tuple, float] = {}
    by_step: dict[str, list[float]] = defaultdict(list)
    keys: dict[tuple, str] = {}
    last = 0.0
    for effect_key, generation, pid, key, edge, t in rows:
        attempt = (effect_key, generation, pid)
        keys[attempt] = key
        last = max(last, t)
        if edge == "start":
            starts[attempt] = t
            by_step[effect_key].append(t)
        else:
            ends[attempt] = t
    # A slot belongs to the run, not to an attempt (docs/flow-control.md): a run taken
    # over while its earlier attempt is still inside the action (its worker starved
    # past the lease on a loaded host, not dead; fenced from then on) continues in the
    # same slot. Attempts of one step that overlap are therefore one interval; two
    # runs of a key at once are still two.
    by_step_of_key: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for attempt, began in starts.items():
        end = ends.get(attempt)
        if end is None:
            later = [t for t in by_step[attempt[0]] if t > began]
            end = min(later) if later else last
        by_step_of_key[keys[attempt], attempt[0]].append((began, end))
    spans: dict[str, list] = defaultdict(list)
    for (key, _), intervals in by_step_of_key.items():
        merged: list[tuple[float, float]] = []
        for began, end in sorted(intervals):
            if merged and began < merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((began, end))
        spans[key].extend(merged)
    return spans


def test_overlapping_attempts_of_one_run_are_one_span_and_two_runs_are_two():
    """The measure itself: a run taken over while its first attempt is still inside the
    action holds one slot; a third run of the key beside two others is three."""
    rows = [
        ("r1", 1, 10, "k", "start", 0.0),
        ("r1", 2, 11, "k", "start", 1.0),  # taken over; the first attempt still naps
        ("r2", 1, 12, "k", "start", 1.5),
        ("r1", 1, 10, "k", "end", 2.0),
        ("r2", 1, 12, "k", "end", 2.5),
        ("r1", 2, 11, "k", "end", 3.0),
    ]
    assert max_overlap(spans_by_key(rows)["k"]) == 2
    third = [("r3", 1, 13, "k", "start", 1.8), ("r3", 1, 13, "k", "end", 2.2)]
    assert max_overlap(spans_by_key(rows + third)["k"]) == 3


ROWS_SQL = """
SELECT effect_key, generation, pid, payload->>'key', payload->>'edge',
       EXTRACT(EPOCH FROM created_at)::float8
  FROM tests_providercall WHERE action = 'flow.span' ORDER BY id
"""


# -- concurrency keys through SIGKILL and a PostgreSQL restart --------------------------


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    try:
        c.sql("CREATE DATABASE k2b_flow_fleet")
        manage(c.url("k2b_flow_fleet"), "migrate", "--noinput", "-v0")
        yield c
    finally:
        c.destroy()


def test_a_key_never_has_more_than_its_limit_running_through_sigkill_and_a_restart(cluster):
    """Limit 2 over 6 keys x 12 runs, 3 workers x 4 threads: a worker holding slots is
    killed, PostgreSQL restarts, and no key ever ran more than 2 at once; every run
    succeeded once."""
    url = cluster.url("k2b_flow_fleet")
    django_script(
        url,
        "from k2b_workflows import start_workflow_run\n"
        f"for i in range({KEYS * PER_KEY}):\n"
        f"    k = f'k{{i % {KEYS}}}'\n"
        "    start_workflow_run('flow.keyed', {'key': k, 'nap': 0.3}, concurrency_key=k)\n",
    )
    env = {
        "DATABASE_URL": url,
        "K2B_TEST_DB_NAME": "",
        "K2B_TEST_SETTINGS": json.dumps({"RUN_LEASE_MS": 3000}),
    }
    fleet = [WorkerProcess("", env, ["--concurrency", "4"]) for _ in range(3)]
    try:

        def open_spans_of(pid: int) -> int:
            rows = cluster.sql(ROWS_SQL, database="k2b_flow_fleet")
            attempts = defaultdict(set)
            for effect_key, generation, row_pid, _, edge, _ in rows:
                attempts[(effect_key, generation, row_pid)].add(edge)
            return sum(1 for (_, _, p), e in attempts.items() if p == pid and e == {"start"})

        victim = fleet[0]
        # Killed while its threads are inside keyed runs: holding their keys' slots.
        wait_for(
            lambda: open_spans_of(victim.pid) >= 2,
            timeout=TIMEOUT,
            interval=0.01,
            message=lambda: f"the victim inside two runs:\n{victim.report()}",
        )
        held = cluster.sql(
            "SELECT count(*) FROM k2b_run WHERE holds_slot AND status = 'running'"
            " AND claimed_by LIKE %s",
            [f"%:{victim.pid}:%"],
            database="k2b_flow_fleet",
        )[0][0]
        victim.kill()
        assert held >= 1

        def succeeded() -> int:
            return cluster.sql(
                "SELECT count(*) FROM k2b_run WHERE status = 'succeeded'", database="k2b_flow_fleet"
            )[0][0]

        wait_for(lambda: succeeded() >= 24, timeout=TIMEOUT, message="a third of the runs")
        cluster.restart("fast")
        wait_for(
            lambda: succeeded() == KEYS * PER_KEY,
            timeout=TIMEOUT,
            message=lambda: f"every run:\n{fleet[1].report()}",
        )
        for worker in fleet[1:]:
            assert worker.proc.poll() is None, worker.report()
    finally:
        for worker in fleet:
            worker.close()

    rows = cluster.sql(ROWS_SQL, database="k2b_flow_fleet")
    spans = spans_by_key(rows)
    overlaps = {key: max_overlap(intervals) for key, intervals in spans.items()}
    print(f"max overlap per key (limit {LIMIT}): {overlaps}")
    assert set(overlaps) == {f"k{i}" for i in range(KEYS)}
    assert max(overlaps.values()) <= LIMIT, overlaps
    # The limit was reached, so it was the slots that bounded it, not a lack of work.
    assert max(overlaps.values()) == LIMIT, overlaps
    runs = cluster.sql(
        """SELECT r.status, r.holds_slot, count(j.id), max(r.generation)
             FROM k2b_run r LEFT JOIN k2b_journal j ON j.run_id = r.id
            GROUP BY r.id""",
        database="k2b_flow_fleet",
    )
    assert len(runs) == KEYS * PER_KEY
    assert {(status, holds, entries) for status, holds, entries, _ in runs} == {
        ("succeeded", False, 1)
    }
    assert max(gen for *_, gen in runs) >= 2  # the killed worker's runs were taken over
    ends = defaultdict(int)
    for effect_key, _, _, _, edge, _ in rows:
        ends[effect_key] += edge == "end"
    assert len(ends) == KEYS * PER_KEY and min(ends.values()) >= 1


# -- a rate limit across workers -----------------------------------------------------------


def windows_over(times: list[float], width: float) -> int:
    """The most timestamps in any half-open window [t, t + width)."""
    times = sorted(times)
    most, j = 0, 0
    for i, t in enumerate(times):
        j = max(j, i)
        while j < len(times) and times[j] < t + width:
            j += 1
        most = max(most, j - i)
    return most


@pytest.mark.django_db(transaction=True)
def test_a_rate_limit_holds_across_three_workers_without_failures_or_second_charges(
    start_worker,
):
    runs = [start_workflow_run("flow.rated", {"n": i}) for i in range(20)]
    fleet = [start_worker("--concurrency", "4") for _ in range(3)]
    wait_for(
        lambda: WorkflowRun.objects.filter(status__in=["succeeded", "failed"]).count() == 20,
        timeout=TIMEOUT,
        message=lambda: fleet[0].report(),
    )
    stored = list(WorkflowRun.objects.filter(pk__in=[r.pk for r in runs]))
    # One budget unit a run: a second charge would have failed it EFFECT_BUDGET_EXCEEDED.
    assert {(r.status, r.error_code) for r in stored} == {("succeeded", "")}
    assert {r.consecutive_failures for r in stored} == {0}
    assert max(r.generation for r in stored) >= 2  # runs were deferred and claimed again
    times = [c.payload["t"] for c in ProviderCall.objects.filter(action="flow.rated")]
    assert len(times) == 20
    most = windows_over(times, 1.0)
    ordered = sorted(times)
    tightest = min(b - a for a, b in zip(ordered, ordered[5:], strict=False))
    print(f"tightest span of 6 consecutive calls: {tightest:.3f} s (must be >= 1 s)")
    print(
        f"most dispatches in any 1 s window: {most} (limit 5), span {max(times) - min(times):.2f} s"
    )
    assert most <= 5, sorted(times)
    assert max(times) - min(times) >= 3.0  # 20 at 5/s: at least 3 windows later
    pids = set(ProviderCall.objects.filter(action="flow.rated").values_list("pid", flat=True))
    assert len(pids) >= 2  # the limit held across processes, not inside one


# -- priorities with real workers -------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_worker_runs_higher_priorities_first(start_worker):
    for i in range(6):
        start_workflow_run("flow.stamp", {"label": f"low{i}"})
    for i in range(6):
        start_workflow_run("flow.stamp", {"label": f"high{i}"}, priority=3)
    worker = start_worker("--concurrency", "1")
    wait_for(
        lambda: ProviderCall.objects.filter(action="flow.stamp").count() == 12,
        timeout=TIMEOUT,
        message=lambda: worker.report(),
    )
    labels = list(
        ProviderCall.objects.filter(action="flow.stamp")
        .order_by("id")
        .values_list("payload__label", flat=True)
    )
    assert labels == [f"high{i}" for i in range(6)] + [f"low{i}" for i in range(6)]


AGING_MS = 250
HIGH = 4


@pytest.mark.django_db(transaction=True)
def test_a_low_priority_run_starts_within_the_aging_bound_under_a_flood(start_worker, settings):
    """Runs of priority 4 keep arriving faster than one thread drains them; a run of
    priority 0 still starts within 4 x PRIORITY_AGING_MS (plus the few runs already
    ahead of it), and the flood is still going when it does."""
    settings.K2B_WORKFLOWS = {**settings.K2B_WORKFLOWS, "PRIORITY_AGING_MS": AGING_MS}
    worker = start_worker("--concurrency", "1")
    stop = threading.Event()
    counter = itertools.count()

    def flood() -> None:
        try:
            while not stop.is_set():
                queued = WorkflowRun.objects.filter(status="queued", priority=HIGH).count()
                for _ in range(max(0, 8 - queued)):
                    start_workflow_run(
                        "flow.stamp", {"label": f"high{next(counter)}", "nap": 0.03}, priority=HIGH
                    )
                time.sleep(0.01)
        finally:
            connection.close()

    thread = threading.Thread(target=flood)
    thread.start()
    try:
        wait_for(
            lambda: ProviderCall.objects.filter(action="flow.stamp").count() >= 10,
            timeout=TIMEOUT,
            message=lambda: worker.report(),
        )
        began = time.time()
        low = start_workflow_run("flow.stamp", {"label": "low", "nap": 0.03})
        bound = HIGH * AGING_MS / 1000
        wait_for(
            lambda: ProviderCall.objects.filter(payload__label="low").exists(),
            timeout=bound + 30,
            message=lambda: worker.report(),
        )
        started = ProviderCall.objects.get(payload__label="low").payload["t"]
    finally:
        stop.set()
        thread.join()
    wait_for(
        lambda: not WorkflowRun.objects.filter(status__in=["queued", "running"]).exists(),
        timeout=TIMEOUT,
        message=lambda: worker.report(),
    )
    # It overtook runs of priority 4 that were queued before it started: aging, not a
    # flood that had dried up.
    before = datetime.fromtimestamp(started, tz=UTC)
    earlier_highs = set(
        WorkflowRun.objects.filter(priority=HIGH, created_at__lt=before).values_list(
            "input__label", flat=True
        )
    )
    later_stamps = set(
        ProviderCall.objects.filter(action="flow.stamp", payload__t__gt=started).values_list(
            "payload__label", flat=True
        )
    )
    assert earlier_highs & later_stamps, "the flood had dried up before the low run started"
    waited = started - began
    print(f"low priority waited {waited:.2f} s under the flood (aging bound {bound:.2f} s)")
    assert waited <= bound + 2.0, waited
    assert low.priority == 0
