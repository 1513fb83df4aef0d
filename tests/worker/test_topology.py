"""The worker's view of its database's topology, on the suite's own server.

The setups themselves (standbys, poolers) are started by tests/crash/test_failover.py
and tests/worker/test_pgbouncer.py; here: what a direct connection to a server
without standbys reports, and the lines each setup gets.
"""

from __future__ import annotations

import pytest

from k2b_workflows.worker import topology
from tests.support.processes import direct_connection_only

pytestmark = pytest.mark.django_db(transaction=True)


@direct_connection_only
def test_a_direct_connection_gets_its_own_notification_and_has_no_pooler_problem():
    assert topology.notifications_arrive("default")
    assert topology.pooler_problems("default", "default", 2000) == []
    assert topology.pooler_problems("default", None, 2000) == []


def test_the_server_reports_a_primary_and_its_synchronous_setting():
    from django.db import connection

    setup = topology.replication("default")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_is_in_recovery(), count(*) FROM pg_stat_replication")
        in_recovery, standbys = cursor.fetchone()
    assert not in_recovery and setup.kind != "standby"
    assert setup.standbys == standbys


@pytest.mark.parametrize(
    ("kind", "standbys", "names", "warns", "says"),
    [
        ("synchronous", 1, "*", False, "loses no commit"),
        ("asynchronous", 2, "", True, "can be dispatched again"),
        ("single", 0, "", False, "single node"),
        ("standby", 0, "", False, "read-only"),
    ],
)
def test_each_setup_says_what_a_failover_would_cost(kind, standbys, names, warns, says):
    setup = topology.Replication(kind=kind, standbys=standbys, synchronous_names=names)
    assert setup.repeats_possible is warns
    assert says in setup.describe()
