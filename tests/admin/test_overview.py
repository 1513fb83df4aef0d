"""The admin's overview: what it counts is right, and every read is an index scan of the window.

``bench/overview.py`` times the page on 1,000,000 runs; here the plans are
read on a table large enough (60,000 runs over 30 days, analyzed) that
PostgreSQL would choose a scan of the whole table if no index served.
"""

from __future__ import annotations

import datetime as dt

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection, transaction
from django.urls import reverse

from bench.overview import seed
from k2b_workflows import pause_queue, queues, start_workflow_run
from k2b_workflows.admin import overview
from k2b_workflows.models import OverviewMinute, WorkerRecord, WorkflowRun
from k2b_workflows.testing import run_until_idle

pytestmark = pytest.mark.django_db(transaction=True)


def db_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT k2b_now()")
        return cursor.fetchone()[0]


def set_times(run: WorkflowRun, *, created_ago: float, finished_ago: float | None) -> None:
    now = db_now()
    WorkflowRun.objects.filter(pk=run.pk).update(
        created_at=now - dt.timedelta(minutes=created_ago),
        finished_at=None if finished_ago is None else now - dt.timedelta(minutes=finished_ago),
    )


def test_the_overview_counts_runs_now_throughput_incidents_and_failing_codes():
    done = [start_workflow_run("test.pure", {"a": i, "b": 1}) for i in range(3)]
    failed = start_workflow_run("test.bad_result", {})
    blind = start_workflow_run("kernel.blind_once", {})
    run_until_idle()
    assert WorkflowRun.objects.get(pk=failed.pk).status == "failed"
    assert WorkflowRun.objects.get(pk=blind.pk).status == "needs_attention"
    queued = start_workflow_run("test.pure", {"a": 9, "b": 9})
    later = start_workflow_run("test.pure", {"a": 8, "b": 8})
    now = db_now()
    WorkflowRun.objects.filter(pk=queued.pk).update(run_after=now - dt.timedelta(minutes=5))
    WorkflowRun.objects.filter(pk=later.pk).update(run_after=now + dt.timedelta(hours=1))
    # Two succeeded in one minute 10 minutes ago, one three hours ago (outside the hour).
    set_times(done[0], created_ago=10.5, finished_ago=10.2)
    set_times(done[1], created_ago=10.5, finished_ago=10.2)
    set_times(done[2], created_ago=181, finished_ago=180)
    set_times(failed, created_ago=30.5, finished_ago=30.2)

    hour = overview.read("hour")
    assert hour.active == {"queued": 2, "running": 0, "waiting": 0, "needs_attention": 1}
    assert hour.queued_due == 1
    assert 5 * 60 - 5 <= hour.oldest_due_s <= 5 * 60 + 60
    assert hour.finished == {"succeeded": 2, "failed": 1, "canceled": 0}
    assert hour.incidents == [("EFFECT_OUTCOME_UNKNOWN", 1)]
    assert hour.failing == [("INVALID_ACTION_RESULT", 1)]
    assert len(hour.finished_per_minute) == 60
    # Minute 59 is the current one: 10.2 minutes ago is minute 48 or 49, by the seconds.
    assert sum(hour.finished_per_minute[48:50]) == 2 and sum(hour.finished_per_minute[28:30]) == 1
    assert sum(hour.finished_per_minute) == 3 and sum(hour.failed_per_minute) == 1
    assert sum(hour.started_per_minute[48:50]) == 2 and sum(hour.started_per_minute[28:30]) == 1
    # queued, later and the incident started just now; done[2] three hours ago: not in the hour.
    assert sum(hour.started_per_minute) == 6

    day = overview.read("day")
    assert len(day.finished_per_minute) == 1440
    assert day.finished == {"succeeded": 3, "failed": 1, "canceled": 0}
    assert sum(day.started_per_minute) == 7


def test_minutes_that_are_over_are_counted_once_and_read_from_the_rollup():
    old, recent = (start_workflow_run("test.pure", {"a": i, "b": 1}) for i in range(2))
    run_until_idle()
    set_times(old, created_ago=20, finished_ago=20)
    set_times(recent, created_ago=0.2, finished_ago=0.1)
    assert overview.read("hour").finished["succeeded"] == 2
    rolled = OverviewMinute.objects.filter(kind="rolled").count()
    assert 57 <= rolled <= 58  # the hour's minutes but the last SETTLE ones
    assert OverviewMinute.objects.filter(kind="finished", status="succeeded").count() == 1
    # Rows changed in a minute that is over are not counted again; the last minutes are live.
    WorkflowRun.objects.filter(pk__in=[old.pk, recent.pk]).update(finished_at=None)
    again = overview.read("hour")
    assert again.finished["succeeded"] == 1 and sum(again.started_per_minute) == 2
    assert OverviewMinute.objects.filter(kind="rolled").count() in (rolled, rolled + 1)


def test_active_counts_are_capped_and_the_page_says_so(monkeypatch):
    for i in range(4):
        start_workflow_run("test.pure", {"a": i, "b": 1})
    monkeypatch.setattr(overview, "COUNT_CAP", 3)
    assert overview.read().active["queued"] == 3


def test_an_unknown_window_is_refused():
    with pytest.raises(ValueError, match="window must be one of"):
        overview.read("week")


@pytest.fixture
def big_table() -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL session_replication_role = replica")
        seed(cursor, runs=60_000, recent=2_000, active=400, now=db_now())
    with connection.cursor() as cursor:
        cursor.execute("VACUUM (ANALYZE) k2b_run")


@pytest.mark.slow
@pytest.mark.parametrize("window", list(overview.WINDOWS))
def test_every_read_of_the_overview_is_an_index_scan_of_the_window(big_table, window):
    params = overview.parameters(window, db_now())
    plans = {}
    with connection.cursor() as cursor:
        for name, sql in overview.STATEMENTS.items():
            cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, {**params, "cap": 100_000})
            plans[name] = cursor.fetchone()[0][0]["Plan"]

    def nodes(plan: dict) -> list[dict]:
        return [plan, *(n for child in plan.get("Plans", []) for n in nodes(child))]

    for name, plan in plans.items():
        if name == "stored":
            continue  # the rollup: at most two days of minutes (older rows are deleted)
        types = [n["Node Type"] for n in nodes(plan)]
        assert "Seq Scan" not in types and "Bitmap Heap Scan" not in types, (name, types)
    finished = [n for n in nodes(plans["finished"]) if n.get("Index Name") == "k2b_run_finished"]
    started = [n for n in nodes(plans["started"]) if n.get("Index Name") == "k2b_run_status"]
    assert [n["Node Type"] for n in finished] == ["Index Only Scan"], plans["finished"]
    assert [n["Node Type"] for n in started] == ["Index Only Scan"], plans["started"]
    # The window's rows only (2,000 recent runs and a day's share of the rest), not 60,000.
    in_window = 2_000 + 58_000 * (1 if window == "hour" else 24) // (30 * 24)
    assert in_window * 0.9 < finished[0]["Actual Rows"] < in_window * 1.1
    assert started[0]["Actual Rows"] < in_window * 1.1 + 400
    for n in nodes(plans["active"]):
        if n["Node Type"] in ("Index Only Scan", "Index Scan"):
            assert n["Actual Rows"] <= 400, n


@pytest.mark.slow
def test_every_read_of_the_queues_page_is_an_index_scan_stopped_at_its_cap(big_table):
    """The Queues page (#49) on 60,000 runs in three queues: the queues found by
    skipping through ``k2b_run_queue_status``, each status counted through it up to
    the cap, never a scan of the table."""
    with connection.cursor() as cursor:
        cursor.execute("UPDATE k2b_run SET queue = 'mail' WHERE id::text < '5'")
        cursor.execute("UPDATE k2b_run SET queue = 'reports' WHERE id::text > 'e'")
        cursor.execute("VACUUM (ANALYZE) k2b_run")
    pause_queue("paused-before-its-first-run", reason="a queue only the pause names")
    cap = queues.COUNT_CAP
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + queues.STATEMENTS["queues"], [100])
        found = cursor.fetchone()[0][0]["Plan"]
        names = ["default", "mail", "paused-before-its-first-run", "reports"]
        cursor.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + queues.STATEMENTS["view"],
            queues.view_parameters(names),
        )
        view = cursor.fetchone()[0][0]
        print("queues page, one statement:", view["Execution Time"], "ms")
        view = view["Plan"]

    def nodes(plan: dict) -> list[dict]:
        return [plan, *(n for child in plan.get("Plans", []) for n in nodes(child))]

    for plan in (found, view):
        types = [n["Node Type"] for n in nodes(plan)]
        assert "Seq Scan" not in types and "Bitmap Heap Scan" not in types, types
    scans = [n for n in nodes(view) if n.get("Relation Name") == "k2b_run"]
    assert scans and all(n["Actual Rows"] <= cap for n in scans), scans
    assert [v.name for v in queues.read()] == names


def test_the_page_needs_the_view_permission(client):
    User.objects.create_user("nobody", password="x", is_staff=True)
    client.login(username="nobody", password="x")
    assert client.get(reverse("admin:k2b_workflows_overview")).status_code == 403


def test_the_page_shows_the_counts_and_an_svg_chart_without_scripts(client):
    start_workflow_run("test.pure", {"a": 1, "b": 1})
    now = db_now()
    WorkerRecord.objects.create(
        worker_id="w1",
        host="h",
        pid=1,
        concurrency=4,
        in_flight=3,
        started_at=now,
        heartbeat_at=now,
    )
    user = User.objects.create_user("viewer", password="x", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_workflowrun"))
    client.login(username="viewer", password="x")
    page = client.get(reverse("admin:k2b_workflows_overview") + "?window=day")
    html = page.content.decode()
    assert page.status_code == 200
    assert "<svg" in html and html.count("<polyline") == 3
    assert "Runs per minute, last day" in html and "<script" not in html.split("<svg", 1)[1]
    assert "3 / 4" in html  # busy threads of the live workers
    bad = client.get(reverse("admin:k2b_workflows_overview") + "?window=<x>")
    assert bad.status_code == 200 and "<x>" not in bad.content.decode()
