"""Workers that never die: database restarts, ended sessions, freezes, start-up and shutdown.

The restart tests run against a PostgreSQL cluster the test starts itself
(``tests/support/pgcluster.py``): the shared server is never restarted. Afterwards
every worker process is still alive, every run ended, no effect happened twice
and no stale write committed.
"""

from __future__ import annotations

import itertools
import json
import random
import signal
import sys
import threading
import time

import pytest

from tests.support import pgcluster
from tests.support.pgcluster import Cluster, django_script, manage
from tests.support.processes import WorkerProcess, direct_connection_only, wait_for

pytestmark = [pytest.mark.crash, pytest.mark.slow]

TIMEOUT = 180  # generous: the machine is shared; nothing here is a timing assertion
RUNS = 18


# A cluster of the module's own with a migrated template, a fresh copy of it for each
# test, and the workers a test starts, closed after it.
cluster = pgcluster.template_cluster
database = pgcluster.template_copy
workers = pgcluster.workers

_names = itertools.count()


def start_runs(url: str, count: int, nap: float = 0.2) -> None:
    django_script(
        url,
        "from k2b_workflows import start_workflow_run\n"
        f"for i in range({count}):\n"
        f"    start_workflow_run('survive.mixed', {{'key': f'r{{i}}', 'n': i, 'nap': {nap}}})\n",
    )


def statuses(cluster: Cluster, database: str) -> dict[str, int]:
    rows = cluster.sql("SELECT status, count(*) FROM k2b_run GROUP BY status", database=database)
    return dict(rows)


def ended(cluster: Cluster, database: str) -> int:
    counts = statuses(cluster, database)
    return sum(n for s, n in counts.items() if s in ("succeeded", "failed", "needs_attention"))


INVARIANTS = """
import json
from collections import Counter
from k2b_workflows.kernel import evidence
from k2b_workflows.models import JournalEntry, WorkflowRun
from tests.models import DomainRow, ProviderCall

runs = list(WorkflowRun.objects.all())
charges = Counter(
    ProviderCall.objects.filter(action="test.charge").values_list("effect_key", flat=True)
)
rows = Counter(DomainRow.objects.values_list("key", flat=True))
# An IDEMPOTENT step's fenced write, "idem:<run>:<seq>:<generation>". A step may run
# again with the same effect key (the design's contract) when the database went away
# between its fenced write and its journal entry's commit; so each effect key may
# have writes of several generations, but never two of one generation, and never one
# of a generation later than the one that journaled the step (a journaled step never
# runs again). Stale writes are test_fence.py's.
journaled = {
    f"idem:{run_id}:{seq}": generation
    for run_id, seq, generation in JournalEntry.objects.filter(
        action_name="test.send_idempotent", state="succeeded"
    ).values_list("run_id", "seq", "generation")
}
idem = {}
for key, n in rows.items():
    if key.startswith("idem:"):
        effect_key, generation = key.rsplit(":", 1)
        idem.setdefault(effect_key, []).extend([int(generation)] * n)
print(json.dumps({
    "statuses": dict(Counter(r.status for r in runs)),
    "failed": [(r.error_code, r.error_message) for r in runs if r.status != "succeeded"],
    "broken_chains": [str(r.pk) for r in runs if evidence.verify_chains(r.pk, "default")],
    "stale_entries": JournalEntry.objects.filter(
        generation__gt=__import__("django.db.models", fromlist=["F"]).F("run__generation")
    ).count(),
    "duplicate_charges": [k for k, n in charges.items() if n > 1],
    "duplicate_tx_rows": [k for k, n in rows.items() if k.startswith("tx:") and n > 1],
    "idempotent_writes_against_the_journal": [
        (k, sorted(gens), journaled.get(k)) for k, gens in idem.items()
        if len(set(gens)) < len(gens) or journaled.get(k) not in gens
        or max(gens) > journaled[k]
    ],
    "idempotent_reruns": sorted(k for k, gens in idem.items() if len(gens) > 1),
    "succeeded_without_charge": [
        str(r.pk) for r in runs if r.status == "succeeded" and charges[f"{r.pk}:5"] != 1
    ],
}))
"""


def assert_invariants(url: str, runs: int) -> dict:
    report = json.loads(django_script(url, INVARIANTS).strip().splitlines()[-1])
    assert sum(report["statuses"].values()) == runs, report
    # A run ends succeeded; it may fail only where the kernel must not guess: a charge
    # whose dispatch committed while the database went away, and which the provider
    # then reports absent (reconcile), fails its step. Weather never exhausts retries.
    assert set(report["statuses"]) <= {"succeeded", "failed"}, report
    assert all(code == "ACTION_FAILED" for code, _ in report["failed"]), report
    assert report["statuses"].get("succeeded", 0) >= runs // 2, report
    for key in (
        "broken_chains",
        "duplicate_charges",
        "duplicate_tx_rows",
        "idempotent_writes_against_the_journal",
        "succeeded_without_charge",
    ):
        assert report[key] == [], (key, report)
    assert report["stale_entries"] == 0, report
    return report


def started(fleet: list[WorkerProcess]) -> None:
    """Every worker is past its start-up (a restart before that tests the start-up wait)."""
    wait_for(
        lambda: all(" thread(s), apps " in w.output() for w in fleet),
        timeout=TIMEOUT,
        message="every worker to start",
    )


def all_alive(fleet: list[WorkerProcess]) -> None:
    for worker in fleet:
        assert worker.proc.poll() is None, (
            f"worker {worker.pid} died ({worker.proc.returncode}):\n{worker.output()[-3000:]}"
        )


def stop_all(fleet: list[WorkerProcess]) -> None:
    for worker in fleet:
        worker.signal(signal.SIGTERM)
    for worker in fleet:
        code = worker.wait(timeout=TIMEOUT)
        assert code == 0, f"worker {worker.pid} exited {code}:\n{worker.output()[-3000:]}"


# -- the database goes away under running workers -------------------------------------


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_workers_outlive_database_restarts_and_every_run_completes_once(
    cluster, database, workers, mode
):
    url = cluster.url(database)
    fleet = [workers(url, "--concurrency", "2") for _ in range(3)]
    start_runs(url, RUNS)
    started(fleet)
    wait_for(lambda: ended(cluster, database) >= 2, timeout=TIMEOUT, message="first runs")

    cluster.restart(mode)
    # Every worker's connections died with the server: each says so, once, and lives on.
    wait_for(
        lambda: all("database unavailable" in w.output() for w in fleet),
        timeout=TIMEOUT,
        message="every worker to notice the restart:\n"
        + "\n".join(w.output()[-1500:] for w in fleet),
    )
    wait_for(
        lambda: ended(cluster, database) >= RUNS // 2,
        timeout=TIMEOUT,
        message=lambda: f"runs after the first restart:\n{fleet[0].report()}",
    )
    all_alive(fleet)
    cluster.restart(mode)
    wait_for(
        lambda: ended(cluster, database) == RUNS,
        timeout=TIMEOUT,
        message=lambda: f"every run after the second restart:\n{fleet[0].report()}",
    )

    all_alive(fleet)
    assert_invariants(url, RUNS)
    stop_all(fleet)


def test_workers_outlive_their_backends_being_terminated_at_random(cluster, database, workers):
    url = cluster.url(database)
    fleet = [workers(url, "--concurrency", "2") for _ in range(3)]
    # Two naps of 0.5 s per run, 18 runs on 6 threads: the runs are in flight for 3 s
    # at least however fast the machine, time for a kill every 0.4 s at most.
    start_runs(url, RUNS, nap=0.5)
    started(fleet)
    rng = random.Random(8)
    killed = 0
    deadline = time.monotonic() + TIMEOUT
    while ended(cluster, database) < RUNS and time.monotonic() < deadline:
        backends = cluster.sql(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            [database],
        )
        if backends and killed < 40:
            (pid,) = rng.choice(backends)
            cluster.sql("SELECT pg_terminate_backend(%s)", [pid])
            killed += 1
        time.sleep(rng.uniform(0.05, 0.4))
    all_alive(fleet)
    assert killed >= 5, "the chaos loop found few backends to end"
    wait_for(lambda: ended(cluster, database) == RUNS, timeout=TIMEOUT, message="every run")
    assert_invariants(url, RUNS)
    stop_all(fleet)


# -- frozen past the lease ------------------------------------------------------------


def is_stopped(pid: int) -> bool:
    from pathlib import Path

    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.django_db(transaction=True)
def test_a_worker_frozen_past_its_lease_with_its_sessions_ended_resumes_and_keeps_working(
    start_worker,
):
    """What a SIGSTOP inside a claim transaction leads to: on SIGCONT every session is gone."""
    from django.db import connection

    from k2b_workflows import start_workflow_run
    from k2b_workflows.store import lease_ms
    from tests.support.kernel import fresh

    worker = start_worker("--concurrency", "2")
    first = start_workflow_run("test.pure", {"a": 1, "b": 1})
    wait_for(lambda: fresh(first).status == "succeeded", timeout=TIMEOUT, message="first run")

    worker.signal(signal.SIGSTOP)
    wait_for(lambda: is_stopped(worker.pid), timeout=TIMEOUT, message="the freeze")
    frozen_at = time.monotonic()
    # The server ends the sessions of a process frozen past its lease (the idle-in-
    # transaction timeout does it to one inside a transaction; a failover to all).
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    wait_for(lambda: time.monotonic() - frozen_at > lease_ms() / 1000, message="the lease")
    worker.signal(signal.SIGCONT)

    second = start_workflow_run("test.pure", {"a": 2, "b": 2})
    wait_for(
        lambda: fresh(second).status == "succeeded",
        timeout=TIMEOUT,
        message=lambda: f"the thawed worker to run again:\n{worker.report()}",
    )
    assert f":{worker.pid}:" in fresh(second).claimed_by
    assert worker.proc.poll() is None, worker.output()
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()


# -- start-up ---------------------------------------------------------------------------


def test_a_worker_started_before_its_database_waits_then_connects(cluster, database, workers):
    url = cluster.url(database)
    cluster.stop()
    try:
        worker = workers(url, "--concurrency", "1")
        wait_for(
            lambda: "waiting for the database" in worker.output(),
            timeout=TIMEOUT,
            message="the waiting notice",
        )
        assert worker.proc.poll() is None, worker.output()
    finally:
        cluster.start()
    start_runs(url, 1, nap=0)
    wait_for(
        lambda: statuses(cluster, database).get("succeeded") == 1,
        timeout=TIMEOUT,
        message=lambda: f"the run:\n{worker.report()}",
    )
    assert "Traceback" not in worker.output()
    stop_all([worker])


def test_wait_for_db_bounds_the_wait_with_one_line(workers, tmp_path):
    unreachable = f"postgresql://postgres@/k2b?host={tmp_path}"  # no server on that socket
    worker = workers(unreachable, "--wait-for-db", "1")
    assert worker.wait(timeout=TIMEOUT) == 1, worker.output()
    out = worker.output()
    assert "database unreachable" in out and "--wait-for-db" in out, out
    assert "Traceback" not in out, out


def test_an_unmigrated_database_exits_2_saying_to_migrate(cluster, workers):
    name = f"k2b_empty_{next(_names)}"
    cluster.sql(f"CREATE DATABASE {name}")
    url = cluster.url(name)

    worker = workers(url, "--concurrency", "1")
    assert worker.wait(timeout=TIMEOUT) == 2, worker.output()
    assert "manage.py migrate" in worker.output() and "Traceback" not in worker.output()

    listing = manage(url, "workflowruns", check=False)
    assert listing.returncode == 2, listing.stderr
    assert "manage.py migrate" in listing.stderr and "Traceback" not in listing.stderr

    out = django_script(
        url,
        "from k2b_workflows import DatabaseNotMigrated, start_workflow_run\n"
        "try:\n"
        "    start_workflow_run('test.pure', {'a': 1, 'b': 1})\n"
        "except DatabaseNotMigrated as exc:\n"
        "    print('refused:', exc)\n",
    )
    assert out.startswith("refused:") and "manage.py migrate" in out, out


# -- a connection shortage ----------------------------------------------------------------


def test_a_connection_shortage_hands_runs_back_without_counting_a_failure(
    cluster, database, workers
):
    """Fewer connections free than the worker has threads: runs wait, never fail."""
    import psycopg

    role = f"k2b_short_{next(_names)}"
    cluster.sql(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 9")
    for what in ("TABLES", "SEQUENCES"):
        cluster.sql(f"GRANT ALL ON ALL {what} IN SCHEMA public TO {role}", database=database)
    start_runs(cluster.url(database), 8, nap=0.05)
    # The role's limit fits the worker (4 threads + main loop, listener, lease keeper,
    # heartbeat), but other clients of the role hold 4: one connection is left for
    # the four threads, as when a web tier takes what the workers were sized for.
    held = [psycopg.connect(cluster.url(database, user=role)) for _ in range(4)]
    worker = workers(
        cluster.url(database, user=role),
        "--concurrency",
        "4",
        settings={"RUN_LEASE_MS": 60_000},  # an expiry cannot hide a missing hand-back
    )
    wait_for(
        lambda: statuses(cluster, database).get("succeeded") == 8,
        timeout=TIMEOUT,
        message=lambda: f"every run:\n{worker.report()}",
    )
    out = worker.output()
    assert "database unavailable" in out and "lease expired" not in out, out[-3000:]
    rows = cluster.sql(
        "SELECT max(consecutive_failures), count(*) FILTER (WHERE error_message <> '')"
        " FROM k2b_run",
        database=database,
    )
    assert rows == [(0, 0)], rows
    stop_all([worker])
    for conn in held:
        conn.close()


# -- shutting down ------------------------------------------------------------------------


def long_lease(**more: int) -> dict[str, str]:
    """Worker settings under which only a hand-back, never an expiry, can free a run in time."""
    return {"K2B_TEST_SETTINGS": json.dumps({"RUN_LEASE_MS": 120_000, **more})}


@pytest.mark.django_db(transaction=True)
def test_sigterm_hands_claimed_runs_back_after_the_grace_and_another_worker_continues(
    start_worker,
):
    from k2b_workflows import start_workflow_run
    from tests.models import ProviderCall
    from tests.support.kernel import fresh

    slow = start_workflow_run("kernel.slow", {"seconds": 600})
    charge = start_workflow_run(
        "test.charge", {"amount": 3, "pause": "external_after_effect", "pause_s": 600}
    )
    first = start_worker("--concurrency", "2", env=long_lease(SHUTDOWN_GRACE_MS=300))
    wait_for(
        lambda: ProviderCall.objects.filter(action__in=["kernel.slow", "test.charge"]).count() == 2,
        timeout=TIMEOUT,
        message=lambda: f"both steps to start:\n{first.report()}",
    )
    claimed = {run.pk: fresh(run).generation for run in (slow, charge)}
    first.signal(signal.SIGTERM)
    # After the grace the PURE step's run is handed back; the worker goes on waiting
    # for the charge's call, which only a second signal cuts (#51).
    wait_for(
        lambda: fresh(slow).status == "queued" or first.proc.poll() is not None,
        timeout=TIMEOUT,
        message=lambda: f"the pure step's run to be handed back:\n{first.report()}",
    )
    assert first.proc.poll() is None, f"the call was not waited for:\n{first.output()}"
    assert fresh(charge).status == "running"
    first.signal(signal.SIGTERM)
    assert first.wait(timeout=TIMEOUT) == 0, first.output()

    for run in (slow, charge):
        back = fresh(run)
        assert (back.status, back.claimed_by, back.consecutive_failures) == ("queued", "", 0)
        assert back.generation == claimed[run.pk]
    # The PURE step may run again now; the charge whose run() was in flight waits one
    # lease, as after a crash, before anyone asks the provider what happened.
    pure, external = fresh(slow), fresh(charge)
    assert (pure.run_after - pure.updated_at).total_seconds() < 60
    assert (external.run_after - external.updated_at).total_seconds() >= 119

    second = start_worker("--concurrency", "2", env=long_lease())
    wait_for(
        lambda: fresh(slow).generation > claimed[slow.pk],
        timeout=TIMEOUT,
        message=lambda: f"another worker to take the run:\n{second.report()}",
    )
    taken = fresh(slow)
    assert f":{second.pid}:" in taken.claimed_by and taken.consecutive_failures == 0
    assert "lease expired" not in taken.error_message


@pytest.mark.django_db(transaction=True)
def test_a_second_sigterm_hands_back_and_exits_now(start_worker):
    from k2b_workflows import start_workflow_run
    from tests.models import ProviderCall
    from tests.support.kernel import fresh

    run = start_workflow_run("kernel.slow", {"seconds": 600})
    worker = start_worker("--concurrency", "1", env=long_lease(SHUTDOWN_GRACE_MS=600_000))
    wait_for(
        lambda: ProviderCall.objects.filter(action="kernel.slow").exists(),
        timeout=TIMEOUT,
        message=lambda: f"the slow step to start:\n{worker.report()}",
    )
    worker.signal(signal.SIGTERM)
    wait_for(lambda: "received SIGTERM" in worker.output(), timeout=TIMEOUT, message="notice")
    assert worker.proc.poll() is None, "the first signal waits for the step"
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()
    back = fresh(run)
    assert (back.status, back.claimed_by, back.consecutive_failures) == ("queued", "", 0), (
        worker.output()
    )


def _blocked_in(thread: threading.Thread, function: str) -> bool:
    """True while ``thread`` is inside ``function`` (it waits there: nothing else can run it)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


@pytest.mark.django_db(transaction=True)
def test_a_hand_back_is_not_skipped_for_the_lease_keepers_own_renewal(monkeypatch):
    """The keeper's renewal locks the row until it commits; a shutdown meanwhile
    handed back nothing ("locked by a step") and left the run to its lease."""
    from django.db import connections

    from k2b_workflows import start_workflow_run
    from k2b_workflows.kernel import leases
    from k2b_workflows.worker.loop import Worker
    from tests.support.kernel import fresh

    run = start_workflow_run("test.pure", {"n": 1})
    worker = Worker(concurrency=1, listen=False)
    (claimed,), _, _ = worker.claim(1)
    worker.claims.claimed[run.pk] = claimed[1]
    worker.keeper.track(run.pk, claimed[1], threading.Event())

    renewing, commit = threading.Event(), threading.Event()
    renew_leases = leases.renew_leases

    def slow_commit(conn, held, lease):
        with conn.transaction():  # as a loaded server's slow commit: the row stays locked
            renewed = renew_leases(conn, held, lease)
            renewing.set()
            assert commit.wait(60)
        return renewed

    monkeypatch.setattr(leases, "renew_leases", slow_commit)
    worker.keeper.start()
    try:
        assert renewing.wait(60), "the keeper renewed nothing"

        def stop() -> None:
            try:
                worker.claims.hand_back_claimed()
            finally:
                connections.close_all()

        stopping = threading.Thread(target=stop)
        stopping.start()
        wait_for(
            lambda: not stopping.is_alive() or _blocked_in(stopping, "paused"),
            message="the hand-back to end or to wait for the renewal",
        )
        commit.set()
        stopping.join(60)
    finally:
        commit.set()
        worker.keeper.stop()
    back = fresh(run)
    assert (back.status, back.claimed_by, back.consecutive_failures) == ("queued", "", 0)
    assert worker.stats["handed_back"] == 1


@pytest.mark.django_db(transaction=True)
@direct_connection_only
def test_runs_claimed_by_a_commit_that_lost_its_answer_are_handed_back_on_reconnect(start_worker):
    """The claim committed, its answer never came back: the worker finds the runs again."""
    import re

    from django.db import connection, transaction

    from k2b_workflows import start_workflow_run
    from tests.support.kernel import fresh

    worker = start_worker("--concurrency", "1", env=long_lease())
    found = wait_for(
        lambda: re.search(r"worker (\S+): \d+ thread", worker.output()),
        timeout=TIMEOUT,
        message="the worker's start",
    )
    worker_id = found.group(1)  # type: ignore[union-attr]
    with transaction.atomic(), connection.cursor() as cursor:
        run = start_workflow_run("test.pure", {"a": 1, "b": 2})
        # What the worker's claim wrote; the worker never saw it return.
        cursor.execute(
            "UPDATE k2b_run SET status = 'running', generation = generation + 1,"
            " claimed_by = %s, lease_expires_at = now() + interval '600 s' WHERE id = %s",
            [worker_id, run.pk],
        )
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    wait_for(
        lambda: fresh(run).status == "succeeded",
        timeout=TIMEOUT,
        message=lambda: f"the orphaned run to be handed back and run:\n{worker.report()}",
    )
    done = fresh(run)
    assert done.consecutive_failures == 0 and done.generation == 2
    assert "claimed while the database connection was lost" in worker.output()


@pytest.mark.django_db(transaction=True)
@direct_connection_only
def test_a_connection_lost_while_rolling_back_an_empty_claim_still_looks_for_orphans(
    monkeypatch, caplog
):
    """A claim that took nothing ends with a ROLLBACK; if that finds the connection
    gone it closes it quietly, and the loop's next pass runs on a new connection
    without ever seeing an error. A claim of this worker's may have committed with
    its answer lost on the old one: the replaced connection alone must send the
    worker looking for orphans (seen under load: the run sat claimed until its
    lease ran out)."""
    from concurrent.futures import ThreadPoolExecutor

    import psycopg
    from django.db import connection

    from k2b_workflows import start_workflow_run
    from k2b_workflows.kernel import db
    from k2b_workflows.worker.loop import Worker
    from tests.support.kernel import fresh

    worker = Worker(concurrency=1, listen=False)
    pool = ThreadPoolExecutor(1)
    rollback_quietly = db.rollback_quietly
    connection.ensure_connection()  # as ``Worker.start_up`` leaves it
    worker.connections.watch()  # as ``Worker.run`` does next

    def ended_before_the_rollback(using: str) -> None:
        monkeypatch.setattr(db, "rollback_quietly", rollback_quietly)
        info = connection.connection.info
        # Ended from outside (a failover, an administrator): the ROLLBACK meets it.
        with psycopg.connect(info.dsn, password=info.password, autocommit=True) as other:
            other.execute("SELECT pg_terminate_backend(%s)", [info.backend_pid])
        rollback_quietly(using)

    try:
        worker._iteration(pool, 0.01)
        run = start_workflow_run("test.pure", {"a": 1, "b": 2})
        with connection.cursor() as cursor:
            # A claim of this worker's that committed, its answer lost.
            cursor.execute(
                "UPDATE k2b_run SET status = 'running', generation = generation + 1,"
                " claimed_by = %s, lease_expires_at = now() + interval '600 s' WHERE id = %s",
                [worker.worker_id, run.pk],
            )
        monkeypatch.setattr(db, "rollback_quietly", ended_before_the_rollback)
        # A full pass, not an idle probe (#52): the claim's own ROLLBACK is what is tested.
        worker._idle = False
        with caplog.at_level("WARNING", logger="k2b_workflows"):
            worker._iteration(pool, 0.01)  # claims nothing; its ROLLBACK finds the loss
            assert db.rollback_quietly is rollback_quietly, "the claim never rolled back"
            assert "database unavailable" not in caplog.text  # nothing reached _weather
            wait_for(
                lambda: worker._iteration(pool, 0.01) or fresh(run).status == "succeeded",
                timeout=TIMEOUT,
                message=lambda: f"the orphaned run to be handed back and run: {fresh(run)}",
            )
        assert fresh(run).generation == 2
        assert "claimed while the database connection was lost" in caplog.text
    finally:
        worker.connections.unwatch()
        worker.claims.drain()
        worker.connections.close_all(pool)
        pool.shutdown()
