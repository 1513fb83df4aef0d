"""The fleet an on-call engineer sees: registration, heartbeats, lost workers, status, admin.

Workers are real ``runworkflows`` subprocesses, killed for real. With the
test settings (``RUN_LEASE_MS`` 2000) a worker beats every ~0.7 s and is lost
after 6 s of silence.
"""

from __future__ import annotations

import io
import json
import signal
import time

import pytest
from django.contrib.admin.utils import quote
from django.core.management import call_command
from django.db import connection

from k2b_workflows import fleet, start_workflow_run, store
from k2b_workflows.models import WorkerRecord
from tests.models import ProviderCall
from tests.support.kernel import fresh
from tests.support.processes import workflowstatus

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 90


def row_of(worker) -> WorkerRecord | None:
    return WorkerRecord.objects.filter(pid=worker.pid).first()


def test_a_killed_worker_is_marked_lost_by_the_fleet_after_the_timeout(start_worker, wait):
    doomed = start_worker("--concurrency", "3")
    row = wait(
        lambda: row_of(doomed), timeout=TIMEOUT, message=lambda: f"registration\n{doomed.report()}"
    )
    assert row.state == "alive" and row.concurrency == 3 and row.apps == []
    assert {"name": "test.pure", "version": 1, "app_id": "tests"} in row.workflows
    first_beat = row.heartbeat_at
    wait(
        lambda: row_of(doomed).heartbeat_at > first_beat,
        timeout=TIMEOUT,
        message="a second heartbeat",
    )

    witness = start_worker("--concurrency", "1")
    wait(lambda: row_of(witness), timeout=TIMEOUT, message="the witness to register")
    doomed.signal(signal.SIGKILL)
    doomed.wait()
    # Killed without a word: the row still says alive until its heartbeat is old.
    killed_at_beat = row_of(doomed).heartbeat_at
    assert row_of(doomed).state == "alive"

    # The witness's own heartbeats mark it: nobody in the test calls mark_lost.
    lost = wait(
        lambda: (r := row_of(doomed)) is not None and r.state == "lost" and r,
        timeout=TIMEOUT,
        message="the killed worker to be marked lost",
    )
    assert lost.heartbeat_at == killed_at_beat
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXTRACT(EPOCH FROM now() - %s) * 1000", [killed_at_beat]
        )  # not before the timeout
        assert cursor.fetchone()[0] >= store.worker_lost_after_ms()
    assert row_of(witness).state == "alive"
    assert [w["pid"] for w in fleet.live_workers()] == [witness.pid]


def test_a_worker_busy_longer_than_the_timeout_stays_alive_and_its_run_names_it(
    start_worker, wait, admin_client
):
    seconds = store.worker_lost_after_ms() / 1000 + 2
    run = start_workflow_run("kernel.slow", {"seconds": seconds})
    worker = start_worker("--concurrency", "1")
    wait(
        lambda: ProviderCall.objects.filter(action="kernel.slow").exists(),
        timeout=TIMEOUT,
        message=lambda: f"the slow step to start\n{worker.report()}",
    )
    row = row_of(worker)
    page = admin_client.get(f"/admin/k2b_workflows/workflowrun/{run.pk}/change/")
    assert page.status_code == 200
    assert f">{row.worker_id}</a>" in page.content.decode(), "the run page names its worker"

    wait(
        lambda: row_of(worker).in_flight == 1,
        timeout=TIMEOUT,
        message="a heartbeat to report the run in flight",
    )
    while fresh(run).status == "running":
        # Every pool thread is busy in one step, yet the row never goes stale.
        fleet.mark_lost()
        row = row_of(worker)
        assert row.state == "alive", "a busy worker was marked lost"
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT now() - %s < %s * interval '1 ms'",
                [row.heartbeat_at, store.worker_lost_after_ms()],
            )
            assert cursor.fetchone()[0], "heartbeat as old as the lost timeout while busy"
        time.sleep(0.5)
    assert fresh(run).status in ("succeeded", "queued")


def test_sigterm_marks_the_worker_stopped(start_worker, wait):
    worker = start_worker("--concurrency", "1")
    wait(lambda: row_of(worker), timeout=TIMEOUT, message="registration")
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()
    row = row_of(worker)
    assert row.state == "stopped" and row.stopped_at is not None and row.in_flight == 0
    assert fleet.live_workers() == []


# -- manage.py workflowstatus --------------------------------------------------------------


def beat(app_ids=None, worker_id="test-host:1:abc") -> fleet.Heartbeat:
    heartbeat = fleet.Heartbeat(
        using="default",
        worker_id=worker_id,
        concurrency=2,
        app_ids=app_ids,
        in_flight=lambda: 0,
    )
    assert heartbeat.beat()
    return heartbeat


def test_status_exits_zero_when_nothing_is_queued_even_without_workers():
    code, out, _ = workflowstatus()
    assert code == 0
    assert "live workers: 0" in out


def test_status_exits_one_when_a_queued_run_has_no_live_worker():
    start_workflow_run("test.pure", {"a": 1, "b": 2})
    code, _, err = workflowstatus()
    assert code == 1
    assert "NO LIVE WORKER for test.pure v1 (app tests)" in err


def test_status_exits_zero_when_a_live_worker_can_run_every_queued_run():
    start_workflow_run("test.pure", {"a": 1, "b": 2})
    beat()
    code, out, err = workflowstatus()
    assert code == 0, err
    assert "live workers: 1" in out and "test-host:1:abc" in out


def test_status_counts_only_workers_that_can_run_the_workflow():
    start_workflow_run("test.pure", {"a": 1, "b": 2})
    beat(app_ids=["kernel_other"])  # registered, alive, but another app's workflows only
    assert workflowstatus()[0] == 1


def test_status_wants_the_same_version():
    start_workflow_run("test.pure", {"a": 1, "b": 2})
    beat()
    row = WorkerRecord.objects.get()
    row.workflows = [dict(w, version=2) if w["name"] == "test.pure" else w for w in row.workflows]
    row.save()
    assert workflowstatus()[0] == 1


def test_status_treats_a_silent_worker_as_dead_and_marks_it_lost():
    start_workflow_run("test.pure", {"a": 1, "b": 2})
    beat()
    WorkerRecord.objects.update(heartbeat_at=fresh_past(store.worker_lost_after_ms() + 1000))
    code, out, _ = workflowstatus()
    assert code == 1
    assert "live workers: 0" in out
    assert WorkerRecord.objects.get().state == "lost"


def test_a_worker_silent_for_longer_than_fresh_is_not_live_before_it_is_marked_lost():
    """A SIGKILLed worker was called live with a 71 s old heartbeat (#38): live means a
    heartbeat younger than ``worker_fresh_ms()``, a lease and three beats, not the
    three leases after which the row is marked lost."""
    start_workflow_run("test.pure", {"a": 1, "b": 2})
    beat()
    fresh_ms = store.worker_fresh_ms()
    assert fresh_ms == max(store.lease_ms(), 3 * store.worker_heartbeat_ms())
    assert fresh_ms < store.worker_lost_after_ms()
    WorkerRecord.objects.update(heartbeat_at=fresh_past(fresh_ms - 500))
    assert workflowstatus()[0] == 0
    assert len(fleet.live_workers()) == 1
    WorkerRecord.objects.update(heartbeat_at=fresh_past(fresh_ms + 500))
    code, out, err = workflowstatus()
    assert code == 1, out
    assert "live workers: 0" in out and "NO LIVE WORKER for test.pure" in err
    assert fleet.live_workers() == []
    assert WorkerRecord.objects.get().state == "alive"  # not lost yet: only late


def test_fresh_never_exceeds_the_time_after_which_a_worker_is_lost(settings):
    settings.K2B_WORKFLOWS = {**settings.K2B_WORKFLOWS, "WORKER_LOST_AFTER_MS": 1500}
    assert store.worker_fresh_ms() == 1500


def fresh_past(ms: int):
    import datetime as dt

    from django.utils import timezone

    return timezone.now() - dt.timedelta(milliseconds=ms)


def test_status_json_has_the_counts_the_oldest_queued_age_and_the_workers():
    start_workflow_run("test.pure", {"a": 1, "b": 2})
    start_workflow_run("test.pure", {"a": 2, "b": 2})
    beat()
    code, out, _ = workflowstatus("--json")
    report = json.loads(out)
    assert code == 0
    assert report["runs"]["queued"] == 2 and report["runs"]["succeeded"] == 0
    assert report["queued_due"] == 2
    assert report["oldest_queued_age_s"] >= 0
    assert report["open_incidents"] == 0
    assert [w["worker_id"] for w in report["live_workers"]] == ["test-host:1:abc"]
    assert report["unserved"] == []


def test_a_heartbeat_revives_a_row_marked_lost_and_purge_deletes_old_rows():
    """A worker frozen past the timeout (SIGSTOP) is lost, and alive again when it beats."""
    heartbeat = beat()
    WorkerRecord.objects.update(heartbeat_at=fresh_past(store.worker_lost_after_ms() + 1000))
    assert fleet.mark_lost() == 1
    assert heartbeat.beat()
    assert WorkerRecord.objects.get().state == "alive"

    WorkerRecord.objects.update(state="stopped", heartbeat_at=fresh_past(10_000))
    assert fleet.purge(older_than_ms=60_000) == 0
    assert fleet.purge(older_than_ms=5_000) == 1
    assert not WorkerRecord.objects.exists()


def test_purgeworkflows_deletes_old_rows_of_stopped_and_lost_workers():
    beat(worker_id="old")
    beat(worker_id="alive")
    WorkerRecord.objects.filter(pk="old").update(
        state="lost", heartbeat_at=fresh_past(3 * 86_400_000)
    )
    out = io.StringIO()
    call_command("purgeworkflows", "--older-than-days", "1", stdout=out)
    assert "1 worker rows" in out.getvalue()
    assert list(WorkerRecord.objects.values_list("pk", flat=True)) == ["alive"]


def test_a_failing_heartbeat_is_weather_not_an_error():
    heartbeat = fleet.Heartbeat(
        using="default", worker_id="w", concurrency=1, app_ids=None, in_flight=lambda: 0
    )
    heartbeat._conn = _BrokenConnection()
    assert heartbeat.beat() is False  # logged, connection dropped, no exception
    assert heartbeat._conn is None
    assert heartbeat.beat() is True  # reconnected on the next beat
    assert WorkerRecord.objects.get().worker_id == "w"


class _BrokenConnection:
    def execute(self, *args, **kwargs):
        import psycopg

        raise psycopg.OperationalError("server closed the connection unexpectedly")

    def close(self) -> None:
        pass


# -- the Workers admin page ----------------------------------------------------------------


@pytest.fixture
def admin_client(client, django_user_model):
    user = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(user)
    return client


def test_the_workers_page_lists_the_fleet_read_only(admin_client):
    beat(worker_id="host-a:10:aaa")
    beat(worker_id="host-b:11:bbb", app_ids=["kernel_other"])
    WorkerRecord.objects.filter(pk="host-b:11:bbb").update(
        heartbeat_at=fresh_past(store.worker_lost_after_ms() + 1000)
    )
    page = admin_client.get("/admin/k2b_workflows/workerrecord/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "host-a:10:aaa" in html and "host-b:11:bbb" in html
    assert 'k2b-worker-alive">alive' in html
    assert 'k2b-worker-lost">lost' in html, "a silent row shows lost before anyone marks it"
    assert "test.pure v1" in html  # the list's hover title
    assert "/admin/k2b_workflows/workerrecord/add/" not in html

    assert admin_client.get("/admin/k2b_workflows/workerrecord/add/").status_code == 403
    url = f"/admin/k2b_workflows/workerrecord/{quote('host-a:10:aaa')}"
    detail = admin_client.get(f"{url}/change/")
    assert detail.status_code == 200
    assert 'name="concurrency"' not in detail.content.decode()  # shown, not editable
    assert "<code>test.pure</code>&nbsp;v1" in detail.content.decode()
    posted = admin_client.post(f"{url}/change/", {"concurrency": 99})
    assert posted.status_code == 403
    deleted = admin_client.post(f"{url}/delete/", {"post": "yes"})
    assert deleted.status_code == 403
    assert WorkerRecord.objects.get(pk="host-a:10:aaa").concurrency == 2


def test_the_workers_page_calls_a_worker_late_once_its_heartbeat_is_not_fresh(admin_client):
    """As workflowstatus counts it: not live, and not yet lost (#38)."""
    beat(worker_id="host-c:12:ccc")
    WorkerRecord.objects.update(heartbeat_at=fresh_past(store.worker_fresh_ms() + 500))
    html = admin_client.get("/admin/k2b_workflows/workerrecord/").content.decode()
    assert 'k2b-worker-late">late' in html, html
    assert "k2b-worker-alive" not in html


def test_checks_refuse_an_unknown_listen_alias_and_a_lost_timeout_below_two_beats(settings):
    from k2b_workflows.checks import check_settings

    settings.K2B_WORKFLOWS = {**settings.K2B_WORKFLOWS, "LISTEN_DATABASE": "nope"}
    assert [e.id for e in check_settings()] == ["k2b_workflows.E009"]
    settings.K2B_WORKFLOWS = {
        **settings.K2B_WORKFLOWS,
        "LISTEN_DATABASE": "default",
        "WORKER_HEARTBEAT_MS": 1000,
        "WORKER_LOST_AFTER_MS": 1500,
    }
    assert [e.id for e in check_settings()] == ["k2b_workflows.W004"]
    assert store.listen_database() == "default"
