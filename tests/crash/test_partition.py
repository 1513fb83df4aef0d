"""Workers on two hosts; one host's link to the database is cut while its workers hold runs.

Each host is a network namespace with a veth pair to this one (``tests/support/netns.py``);
PostgreSQL listens on the database side of each pair, and the workers connect
over TCP with keepalives, ``tcp_user_timeout``, ``connect_timeout`` and
statement/lock timeouts, as docs/high-availability.md recommends. The
provider is reached by unix socket, which no link cut touches: a cut-off host
can still call it, as a host cut off from its database but not from the
internet can.

1. Cut host B while it holds runs: host A takes them over after the lease.
   Mend the link: every write B still attempts is fenced (no stale write, no
   repeated charge), and B's worker goes on without a restart.
2. Cut B again, idle: B notices the dead link within the timeouts (measured),
   the fleet page shows it lost; mend it: it beats again, the page shows it
   alive, and it executes new runs.

Needs root and ``ip netns``; skips otherwise. Namespaces and links are removed
in a finally block.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.support import netns
from tests.support.pgcluster import Cluster, django_script, manage
from tests.support.processes import WorkerProcess, wait_for
from tests.support.topology import (
    CLIENT_TIMEOUTS,
    DB,
    TIMEOUT,
    all_alive,
    assert_consistent,
    ended,
    invariants,
    provider_charges,
    stop_all,
)

pytestmark = [pytest.mark.crash, pytest.mark.slow]

RUNS = 8
LEASE_MS = 2000
LOST_AFTER_MS = 4000

# The server side: the backends of a cut-off host end in bounded time too, and
# with them any row lock they held.
SERVER_TIMEOUTS = (
    "tcp_keepalives_idle = 3\ntcp_keepalives_interval = 1\ntcp_keepalives_count = 3\n"
    "tcp_user_timeout = 6000\n"
)
DETECTION_BOUND_S = 3 + 1 * 3 + 3  # keepalive idle + probes, plus one connect_timeout


@pytest.fixture
def network():
    netns.require()
    hosts: list[netns.Host] = []
    try:
        hosts = [netns.Host(0), netns.Host(1)]
        with Cluster(
            listen=",".join(h.server_address for h in hosts),
            conf=SERVER_TIMEOUTS,
            hba="".join(f"host all all {h.address}/32 trust\n" for h in hosts),
        ) as cluster:
            cluster.migrate(DB)
            cluster.add_provider()
            yield cluster, hosts
    finally:
        for host in hosts:
            host.remove()


def tcp_url(host: netns.Host) -> str:
    query = "&".join(f"{key}={value}" for key, value in CLIENT_TIMEOUTS.items())
    return f"postgresql://postgres@{host.server_address}:{5432}/{DB}?{query}"


def start_worker(cluster: Cluster, host: netns.Host) -> WorkerProcess:
    env = {
        "DATABASE_URL": tcp_url(host),
        "K2B_TEST_DB_NAME": "",
        "K2B_TEST_PROVIDER_URL": cluster.url("provider"),
        "K2B_TEST_SETTINGS": json.dumps(
            {"RUN_LEASE_MS": LEASE_MS, "WORKER_LOST_AFTER_MS": LOST_AFTER_MS}
        ),
    }
    return WorkerProcess("", env, ["--concurrency", "3"], prefix=host.prefix())


def worker_id(worker: WorkerProcess) -> str:
    found = wait_for(
        lambda: re.search(r"worker (\S+): \d+ thread\(s\), apps ", worker.output()),
        timeout=TIMEOUT,
        message=lambda: f"the worker to start:\n{worker.report()}",
    )
    return found.group(1)  # type: ignore[union-attr]


def held_by(cluster: Cluster, worker: WorkerProcess) -> set[str]:
    rows = cluster.sql(
        "SELECT id::text FROM k2b_run WHERE status = 'running' AND claimed_by LIKE %s",
        [f"%:{worker.pid}:%"],
        database=DB,
    )
    return {run_id for (run_id,) in rows}


FLEET_PAGE = """
import json, re
from django.contrib.auth.models import User
from django.test import Client
user, _ = User.objects.get_or_create(
    username="ops", defaults={"is_staff": True, "is_superuser": True}
)
client = Client(HTTP_HOST="localhost")
client.force_login(user)
html = client.get("/admin/k2b_workflows/workerrecord/").content.decode()
states = {}
for row in re.findall(r"<tr.*?</tr>", html, re.S):
    badge = re.search(r"k2b-worker-(\\w+)", row)
    for wid in WORKERS:
        if wid in row and badge:
            states[wid] = badge.group(1)
print(json.dumps(states))
"""


def fleet_page(cluster: Cluster, ids: list[str]) -> dict[str, str]:
    script = f"WORKERS = {ids!r}\n{FLEET_PAGE}"
    return json.loads(django_script(cluster.url(DB), script).strip().splitlines()[-1])


def start_runs(cluster: Cluster, count: int, nap: float, prefix: str) -> None:
    django_script(
        cluster.url(DB),
        "from k2b_workflows import start_workflow_run\n"
        f"for i in range({count}):\n"
        f"    start_workflow_run('topology.mixed', "
        f"{{'key': f'{prefix}{{i}}', 'n': i, 'nap': {nap}}})\n",
    )


def test_a_host_cut_off_is_taken_over_fenced_on_return_and_recovers_without_restart(network):
    cluster, (host_a, host_b) = network
    a, b = start_worker(cluster, host_a), start_worker(cluster, host_b)
    try:
        ids = [worker_id(a), worker_id(b)]
        report: dict = {}

        # 1. Cut B while it holds runs: A takes them over after the lease.
        start_runs(cluster, RUNS, nap=3, prefix="p")
        held = wait_for(lambda: held_by(cluster, b), timeout=TIMEOUT, message="host B to hold runs")
        cut = time.monotonic()
        host_b.cut()
        wait_for(
            lambda: not (held_by(cluster, b) & set(held)) and not held_by(cluster, b),
            timeout=TIMEOUT,
            message=lambda: f"host A to take B's runs over:\n{a.report()}",
        )
        report["held_by_the_cut_host"] = len(held)
        report["cut_to_takeover_s"] = round(time.monotonic() - cut, 2)
        b_before_mend = len(b.output())
        host_b.mend()
        wait_for(
            lambda: ended(cluster) == RUNS,
            timeout=TIMEOUT,
            message=lambda: f"every run:\n{a.report()}\n{b.report()}",
        )
        all_alive([a, b])
        # What B tried once its link was back: each attempt refused by the fence.
        after = b.output()[b_before_mend:]
        fenced = [
            line for line in after.splitlines() if ": stopped: " in line or "handed back" in line
        ]
        report["fenced_attempts_logged"] = len(fenced)
        report["fenced_lines"] = sorted(
            {re.sub(r"[0-9a-f-]{36}", "<run>", line.split(": ", 1)[-1])[:160] for line in fenced}
        )

        # 2. Cut B again, idle: it notices within the timeouts, the fleet page shows it lost.
        log_at_cut = len(b.output())
        cut = time.monotonic()
        host_b.cut()
        wait_for(
            lambda: re.search(
                r"database unavailable|heartbeat of \S+ failed", b.output()[log_at_cut:]
            ),
            timeout=TIMEOUT,
            interval=0.1,
            message=lambda: f"host B to notice the cut:\n{b.report()}",
        )
        report["idle_cut_noticed_s"] = round(time.monotonic() - cut, 2)
        wait_for(
            lambda: fleet_page(cluster, ids).get(ids[1]) == "lost",
            timeout=TIMEOUT,
            interval=0.5,
            message=lambda: f"the fleet page to show B lost: {fleet_page(cluster, ids)}",
        )
        report["fleet_page_during_the_cut"] = fleet_page(cluster, ids)
        host_b.mend()
        mended = time.monotonic()
        wait_for(
            lambda: fleet_page(cluster, ids).get(ids[1]) == "alive",
            timeout=TIMEOUT,
            interval=0.2,
            message=lambda: f"B to beat again:\n{b.report()}",
        )
        report["mend_to_alive_s"] = round(time.monotonic() - mended, 2)
        report["fleet_page_after"] = fleet_page(cluster, ids)
        # B executes new runs, in the same process.
        start_runs(cluster, RUNS, nap=0.05, prefix="q")
        wait_for(
            lambda: ended(cluster) == 2 * RUNS,
            timeout=TIMEOUT,
            message=lambda: f"the new runs:\n{b.report()}",
        )
        ran_on_b = cluster.sql(
            "SELECT count(*) FROM tests_domainrow WHERE key LIKE 'tx:q%%' AND pid = %s",
            [b.pid],
            database=DB,
        )[0][0]
        report["new_runs_written_by_b"] = ran_on_b
        all_alive([a, b])

        result = invariants(cluster.url(DB))
        charges = provider_charges(cluster, database="provider")
        result.update(report)
        result["charges"] = sum(charges.values())
        result["duplicate_charges"] = sorted(k for k, n in charges.items() if n > 1)
        print("\npartition:", json.dumps({k: v for k, v in result.items() if k != "succeeded"}))
        assert_consistent(result, 2 * RUNS)
        assert result["duplicate_charges"] == [], result
        assert report["idle_cut_noticed_s"] <= DETECTION_BOUND_S + 5, report
        assert ran_on_b >= 1, report
        # B did try to go on with the runs it had lost, and was refused each time.
        assert report["fenced_attempts_logged"] >= 1, report
        verify = manage(cluster.url(DB), "verifyworkflows", check=False)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        stop_all([a, b])
    finally:
        a.close()
        b.close()
