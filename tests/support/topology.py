"""What the topology tests share: the workload, its invariants, the fleet's life.

The workload is ``topology.mixed`` (``tests/workflows/topology.py``): every
effect class, a durable wait and a fan-out, the provider in a database of its
own. ``INVARIANTS`` runs in a Django process on the database the runs ended on.
"""

from __future__ import annotations

import json
import signal
from typing import Any

from tests.support.pgcluster import Cluster, django_script
from tests.support.processes import WorkerProcess

DB = "k2b"
TIMEOUT = 180  # generous: the machine is shared; nothing here is a timing assertion


def start_runs(url: str, count: int, nap: float) -> None:
    django_script(
        url,
        "from k2b_workflows import start_workflow_run\n"
        f"for i in range({count}):\n"
        f"    start_workflow_run('topology.mixed', {{'key': f'r{{i}}', 'n': i, 'nap': {nap}}})\n",
    )


def ended(cluster: Cluster, database: str = DB) -> int:
    return cluster.sql(
        "SELECT count(*) FROM k2b_run WHERE workflow_name = 'topology.mixed'"
        " AND status IN ('succeeded', 'failed', 'needs_attention')",
        database=database,
    )[0][0]


def journal_rows(cluster: Cluster) -> int:
    return cluster.sql("SELECT count(*) FROM k2b_journal", database=DB)[0][0]


def provider_charges(provider: Cluster, database: str = "postgres") -> dict[str, int]:
    return dict(
        provider.sql(
            "SELECT effect_key, count(*) FROM provider_call"
            " WHERE action = 'topology.charge' GROUP BY effect_key",
            database=database,
        )
    )


INVARIANTS = """
import json
from collections import Counter
from django.db.models import F
from k2b_workflows.kernel import evidence
from k2b_workflows.models import JournalEntry, WorkflowRun
from tests.models import DomainRow

runs = list(WorkflowRun.objects.filter(workflow_name="topology.mixed"))
children = WorkflowRun.objects.filter(workflow_name="topology.child")
rows = Counter(DomainRow.objects.values_list("key", flat=True))
journaled = {
    f"{run_id}:{seq}": generation
    for run_id, seq, generation in JournalEntry.objects.filter(
        action_name="topology.notify", state="succeeded"
    ).values_list("run_id", "seq", "generation")
}
fenced = {}
for key in rows:
    if key.startswith("idem:"):
        effect_key, generation = key[len("idem:"):].rsplit(":", 1)
        fenced.setdefault(effect_key, []).append(int(generation))
print(json.dumps({
    "runs": len(runs),
    "statuses": dict(Counter(r.status for r in runs)),
    "failed": [(r.error_code, r.error_message) for r in runs if r.status != "succeeded"],
    "children": dict(Counter(children.values_list("status", flat=True))),
    "broken_chains": [str(r.pk) for r in runs if evidence.verify_chains(r.pk, "default")],
    "stale_entries": JournalEntry.objects.filter(generation__gt=F("run__generation")).count(),
    "duplicate_tx_rows": [k for k, n in rows.items() if k.startswith("tx:") and n > 1],
    "succeeded_without_tx_row": [
        str(r.pk) for r in runs if r.status == "succeeded" and rows[f"tx:{r.input['key']}"] != 1
    ],
    # A fenced write never of a generation later than the one that journaled the step.
    "stale_fenced_writes": [
        (k, gens) for k, gens in fenced.items() if k in journaled and max(gens) > journaled[k]
    ],
    "succeeded": [str(r.pk) for r in runs if r.status == "succeeded"],
}))
"""


def invariants(url: str) -> dict:
    return json.loads(django_script(url, INVARIANTS).strip().splitlines()[-1])


def all_alive(fleet: list[WorkerProcess]) -> None:
    for worker in fleet:
        assert worker.proc.poll() is None, worker.report()


def stop_all(fleet: list[WorkerProcess]) -> None:
    for worker in fleet:
        worker.signal(signal.SIGTERM)
    for worker in fleet:
        assert worker.wait(timeout=TIMEOUT) == 0, worker.output()[-3000:]


def assert_consistent(report: dict[str, Any], runs: int) -> None:
    """What any topology must keep: every run there and ended, nothing stale or broken."""
    assert report["runs"] == runs, report
    assert set(report["statuses"]) <= {"succeeded", "failed"}, report
    # A run may fail only where the kernel must not guess: a dispatch whose commit
    # answer was lost with the database, which the provider then reports absent.
    assert all(code == "ACTION_FAILED" for code, _ in report["failed"]), report
    for key in ("broken_chains", "duplicate_tx_rows", "stale_fenced_writes"):
        assert report[key] == [], (key, report)
    assert report["succeeded_without_tx_row"] == [], report
    assert report["stale_entries"] == 0, report


# The client side: a dead link is noticed within about 6 s whatever the
# connection is doing (idle: keepalives; waiting for an answer: tcp_user_timeout;
# connecting: connect_timeout), and no statement or lock wait outlives its bound.
CLIENT_TIMEOUTS = {
    "connect_timeout": "3",
    "keepalives": "1",
    "keepalives_idle": "3",
    "keepalives_interval": "1",
    "keepalives_count": "3",
    "tcp_user_timeout": "6000",
    "options": "-c%20statement_timeout%3D10000%20-c%20lock_timeout%3D5000",
}
