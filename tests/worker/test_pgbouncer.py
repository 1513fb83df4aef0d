"""Workers through a real PgBouncer, in transaction and in session pooling mode.

Each test starts its own PgBouncer (``tests/support/pgbouncer.py``) on a loopback port in
front of a private cluster, and runs the workload of every effect class, waits
and fan-out (``topology.mixed``) through it while a worker is SIGKILLed (the
crash path: the others take its runs over after the lease) and PostgreSQL
restarts behind the pooler (the survive path). Then a durable wait is woken
through the pooler and the wake-up must come by LISTEN, not by the poll.

Transaction mode runs with the settings docs/operations.md#pgbouncer names:
``LISTEN_DATABASE`` on a direct connection, the role's
``idle_in_transaction_session_timeout``, and ``prepare_threshold`` None
(PgBouncer before 1.21 has no ``max_prepared_statements``). Without them, the
worker names each misconfiguration at start.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.support import pgbouncer
from tests.support.pgcluster import TEMPLATE, Cluster, Workers, django_script, manage
from tests.support.processes import WorkerProcess, wait_for
from tests.support.topology import (
    TIMEOUT,
    all_alive,
    assert_consistent,
    ended,
    invariants,
    provider_charges,
    stop_all,
)

pytestmark = [pytest.mark.crash, pytest.mark.slow]

RUNS = 12
LEASE_MS = 2000
# Long, so that a wake-up within it can only have come by LISTEN.
POLL_MS = 20000

LISTEN_PROBLEM = "LISTEN through a transaction pooler"
TIMEOUT_PROBLEM = "idle_in_transaction_session_timeout on a pooled connection"


@pytest.fixture(scope="module")
def cluster():
    pgbouncer.require()
    with Cluster() as c:
        c.migrate(TEMPLATE)
        c.add_provider()
        # The documented setting for a transaction pooler, on the role the workers use.
        c.sql(f"ALTER ROLE postgres SET idle_in_transaction_session_timeout = '{LEASE_MS}ms'")
        # A role without it, for the misconfiguration.
        c.sql("CREATE ROLE app LOGIN SUPERUSER")
        yield c


@pytest.fixture
def bouncers(cluster):
    started: list[pgbouncer.Bouncer] = []

    def start(mode: str) -> pgbouncer.Bouncer:
        bouncer = pgbouncer.Bouncer(str(cluster.root), cluster.port, mode, cluster.user)
        started.append(bouncer)
        return bouncer

    yield start
    for bouncer in started:
        bouncer.stop()


@pytest.fixture
def fleet_of(cluster):
    with Workers() as started:

        def start(url: str, env: dict[str, str], count: int) -> list[WorkerProcess]:
            env = {"K2B_TEST_PROVIDER_URL": cluster.url("provider"), **env}
            return started.fleet(url, count, env, TIMEOUT)

        yield start


@pytest.fixture
def database(cluster) -> str:
    """A fresh migrated database on the test's own cluster; the provider's calls emptied."""
    name = cluster.copy()
    cluster.sql("TRUNCATE provider_call", database="provider")
    return name


def transaction_mode_env(cluster: Cluster, database: str, **settings: object) -> dict[str, str]:
    """The documented settings: LISTEN on a direct connection, nothing prepared."""
    return {
        "K2B_TEST_PREPARE": "0",
        "K2B_TEST_DIRECT_URL": cluster.url(database),
        "K2B_TEST_SETTINGS": json.dumps({"LISTEN_DATABASE": "direct", **settings}),
    }


def holding(cluster: Cluster, database: str, worker: WorkerProcess) -> int:
    return cluster.sql(
        "SELECT count(*) FROM k2b_run WHERE status = 'running' AND claimed_by LIKE %s",
        [f"%:{worker.pid}:%"],
        database=database,
    )[0][0]


def workload(
    cluster: Cluster, database: str, url: str, env: dict[str, str], fleet: list[WorkerProcess]
) -> dict:
    """The runs through the pooler; a worker killed holding runs; PostgreSQL restarted."""
    django_script(
        url,
        "from k2b_workflows import start_workflow_run\n"
        f"for i in range({RUNS}):\n"
        "    start_workflow_run('topology.mixed', {'key': f'r{i}', 'n': i, 'nap': 0.3})\n",
        env=env,
    )
    victim = wait_for(
        lambda: next((w for w in fleet if holding(cluster, database, w)), None),
        timeout=TIMEOUT,
        message=lambda: f"a worker to hold a run:\n{fleet[0].report()}",
    )
    held = cluster.sql(
        "SELECT id FROM k2b_run WHERE status = 'running' AND claimed_by LIKE %s",
        [f"%:{victim.pid}:%"],
        database=database,
    )
    victim.kill()
    wait_for(lambda: ended(cluster, database) >= 3, timeout=TIMEOUT, message="runs after the kill")
    in_flight = RUNS - ended(cluster, database)
    # The pooler hides the restart from clients between transactions; those inside
    # one see their connection end, like a direct one.
    cluster.restart("fast")
    wait_for(
        lambda: ended(cluster, database) == RUNS,
        timeout=TIMEOUT,
        message=lambda: f"every run:\n{fleet[-1].report()}",
    )
    survivors = [w for w in fleet if w is not victim]
    all_alive(survivors)
    report = invariants(cluster.url(database))
    charges = provider_charges(cluster, database="provider")
    report["charges"] = sum(charges.values())
    report["duplicate_charges"] = sorted(k for k, n in charges.items() if n > 1)
    # The runs the killed worker held, ended by the others after its lease (failed only
    # where it died between a charge's dispatch and the call: reconciled absent).
    report["taken_over"] = cluster.sql(
        "SELECT count(*) FROM k2b_run WHERE id = ANY(%s) AND status IN ('succeeded', 'failed')",
        [[run_id for (run_id,) in held]],
        database=database,
    )[0][0]
    assert report["taken_over"] >= 1, report
    assert_consistent(report, RUNS)
    assert report["duplicate_charges"] == [], report
    report["unfinished_at_the_restart"] = in_flight
    assert in_flight > 0, "the workload ended before the restart: make the runs longer"
    verify = manage(cluster.url(database), "verifyworkflows", check=False)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    del report["succeeded"]
    report["survivors"] = survivors
    return report


def wake_latency(cluster: Cluster, database: str, url: str, env: dict[str, str]) -> float:
    """Park a run on a gate, wake it through the pooler; seconds to its end."""
    django_script(
        url,
        "from k2b_workflows import start_workflow_run\n"
        "start_workflow_run('waits.gate', {'key': 'door'})\n",
        env=env,
    )
    wait_for(
        lambda: (
            cluster.sql(
                "SELECT count(*) FROM k2b_run WHERE workflow_name = 'waits.gate'"
                " AND status = 'waiting'",
                database=database,
            )[0][0]
            == 1
        ),
        timeout=TIMEOUT,
        message="the run to park",
    )
    woken = time.monotonic()
    django_script(
        url,
        "from django.db import transaction\n"
        "from k2b_workflows import wake_workflow_runs_waiting_on\n"
        "from tests.models import DomainRow\n"
        "with transaction.atomic():\n"
        "    DomainRow.objects.create(key='door', value='open')\n"
        "    wake_workflow_runs_waiting_on(app_id='tests', kind='gate', key='door')\n",
        env=env,
    )
    wait_for(
        lambda: (
            cluster.sql(
                "SELECT count(*) FROM k2b_run WHERE workflow_name = 'waits.gate'"
                " AND status = 'succeeded'",
                database=database,
            )[0][0]
            == 1
        ),
        timeout=TIMEOUT,
        message="the woken run",
    )
    return time.monotonic() - woken


def test_through_a_transaction_pooler_with_the_documented_settings(
    cluster, database, bouncers, fleet_of
):
    bouncer = bouncers("transaction")
    url = bouncer.url(database)
    env = transaction_mode_env(cluster, database, POLL_INTERVAL_MS=POLL_MS)
    fleet = fleet_of(url, env, 3)
    for worker in fleet:
        assert LISTEN_PROBLEM not in worker.output(), worker.output()
        assert TIMEOUT_PROBLEM not in worker.output(), worker.output()
    report = workload(cluster, database, url, env, fleet)
    report["wake_s"] = round(wake_latency(cluster, database, url, env), 2)
    print("\npgbouncer transaction mode:", json.dumps({**report, "survivors": "..."}))
    # The wake came by LISTEN on the direct connection, long before the next poll.
    assert report["wake_s"] < POLL_MS / 1000 / 2, report
    stop_all(report["survivors"])


def test_through_a_session_pooler_workers_work_as_they_are(cluster, database, bouncers, fleet_of):
    bouncer = bouncers("session")
    url = bouncer.url(database)
    env = {"K2B_TEST_SETTINGS": json.dumps({"POLL_INTERVAL_MS": POLL_MS})}
    fleet = fleet_of(url, env, 3)
    for worker in fleet:
        assert LISTEN_PROBLEM not in worker.output(), worker.output()
        assert TIMEOUT_PROBLEM not in worker.output(), worker.output()
    report = workload(cluster, database, url, env, fleet)
    report["wake_s"] = round(wake_latency(cluster, database, url, env), 2)
    print("\npgbouncer session mode:", json.dumps({**report, "survivors": "..."}))
    assert report["wake_s"] < POLL_MS / 1000 / 2, report
    stop_all(report["survivors"])


def probed(worker: WorkerProcess) -> str:
    """The worker's log once its topology probes are done: they run beside its first
    claims (through a transaction pooler a probe waits out PROBE_TIMEOUT_S), and the
    replication line comes after every problem they found."""
    return wait_for(
        lambda: out if "database 'default':" in (out := worker.output()) else None,
        timeout=TIMEOUT,
        message=lambda: f"the topology line\n{worker.report()}",
    )


def test_the_worker_names_each_transaction_pooler_misconfiguration(
    cluster, database, bouncers, fleet_of
):
    bouncer = bouncers("transaction")
    # LISTEN through the pooler, and a role without the timeout.
    env = {"K2B_TEST_PREPARE": "0"}
    (worker,) = fleet_of(bouncer.url(database, user="app"), env, 1)
    out = probed(worker)
    assert out.count(LISTEN_PROBLEM) == 1, out
    assert "LISTEN_DATABASE" in out
    assert out.count(TIMEOUT_PROBLEM) == 1, out
    # "TO", not "=": the log's redaction hides the value of a key naming a session.
    assert f"SET idle_in_transaction_session_timeout TO '{LEASE_MS}ms'" in out, out[-3000:]
    # The role's own timeout set: only the LISTEN problem is left.
    (worker,) = fleet_of(bouncer.url(database), env, 1)
    out = probed(worker)
    assert out.count(LISTEN_PROBLEM) == 1, out
    assert TIMEOUT_PROBLEM not in out, out
    for each in (worker,):
        each.signal(signal.SIGTERM)
        assert each.wait(timeout=TIMEOUT) == 0
