"""A shortage of connections delays claims; it never expires a lease that is held (#30).

The review ran steps longer than the lease with one connection fewer than a
worker needs: the lease keeper, which connected only when it first had to
renew, found none ("remaining connection slots are reserved"), every run it
held expired mid-step, each PURE step ran five times and every run ended
``WORKFLOW_RETRY_EXHAUSTED``. Here the worker runs as a real role whose
``CONNECTION LIMIT`` is one below what it uses when it has enough.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from django.db import connection

from k2b_workflows import start_workflow_run
from k2b_workflows.models import WorkflowRun
from tests.models import ProviderCall
from tests.support import runtime_role
from tests.support.database_url import database_url
from tests.support.runtime_role import RUNTIME

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=["default", RUNTIME]),
]

runtime = runtime_role.runtime

RUNS = 4
STEP_SECONDS = 4.0  # longer than the lease: it must be renewed during the step
# Renewed every third of a lease: a 3 s lease survives a loaded machine's stalls,
# where a 1 s one was lost with enough connections too.
SETTINGS = {"RUN_LEASE_MS": 3000, "RUN_MAX_CONSECUTIVE_FAILURES": 5}


def _connections(role: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE usename = %s", [role])
        return cursor.fetchone()[0]


def _drain(start_worker, role: str, *, timeout: float = 120) -> int:
    """Start ``RUNS`` slow runs, drain them with one worker as ``role``; the most
    connections the role held meanwhile."""
    runs = [
        start_workflow_run("kernel.slow", {"seconds": STEP_SECONDS, "n": i}) for i in range(RUNS)
    ]
    worker = start_worker(
        "--concurrency",
        "2",
        "--burst",
        env={
            "DATABASE_URL": database_url(connection.settings_dict, user=role),
            "K2B_TEST_SETTINGS": json.dumps(SETTINGS),
        },
    )
    peak = 0
    deadline = time.monotonic() + timeout
    while worker.proc.poll() is None:
        assert time.monotonic() < deadline, worker.report()
        peak = max(peak, _connections(role))
        time.sleep(0.05)
    assert worker.proc.returncode == 0, worker.report()
    statuses = Counter(
        WorkflowRun.objects.filter(pk__in=[r.pk for r in runs]).values_list("status", flat=True)
    )
    assert statuses == {"succeeded": RUNS}, (statuses, worker.report())
    return peak


def test_a_worker_short_of_one_connection_expires_no_lease(runtime, start_worker):
    with connection.cursor() as cursor:  # the worker's schema check reads it, as Django's
        cursor.execute(f'GRANT SELECT ON django_migrations TO "{runtime}"')
    enough = _drain(start_worker, runtime)
    assert ProviderCall.objects.filter(action="kernel.slow").count() == RUNS
    ProviderCall.objects.all().delete()
    with connection.cursor() as cursor:
        cursor.execute(f'ALTER ROLE "{runtime}" CONNECTION LIMIT {enough - 1}')
    _drain(start_worker, runtime)
    per_step = Counter(
        ProviderCall.objects.filter(action="kernel.slow").values_list("effect_key", flat=True)
    )
    # Each step ran once: no lease expired while a step held it.
    assert len(per_step) == RUNS and set(per_step.values()) == {1}, per_step
