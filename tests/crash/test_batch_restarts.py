"""A batch drained through PostgreSQL restarts (#50): each callback runs once, after
every member has finished.

The database is restarted twice while the members drain, on a cluster the test
starts itself (``tests/support/pgcluster.py``): the shared server is never
restarted. ``-m immediate`` is a crash of the server: a member's end that had
not committed is lost, and its member runs again; the batch's callbacks are
enqueued by whichever worker's pass finds every member finished once the
server is back, and by that pass alone.
"""

from __future__ import annotations

import pytest

from tests.support import pgcluster
from tests.support.pgcluster import Cluster
from tests.support.processes import wait_for

pytestmark = [pytest.mark.crash, pytest.mark.slow]

TIMEOUT = 180  # generous: the machine is shared; nothing here is a timing assertion
MEMBERS = 60
FAILING = 7

# A cluster of the module's own with a migrated template, a fresh copy of it for each
# test, and the workers a test starts, closed after it.
cluster = pgcluster.template_cluster
database = pgcluster.template_copy
workers = pgcluster.workers

ENQUEUE = f"""
from k2b_workflows.tasks import enqueue_batch
from tests.tasks_app import batched as b
batch = enqueue_batch(
    b.member,
    [((i,), {{"fail": i == {FAILING}, "seconds": 0.2}}) for i in range({MEMBERS})],
    on_finish=b.on_finish, on_success=b.on_success, on_failure=b.on_failure,
)
print(batch.id)
"""

MEMBER = "input ? 'batch' AND input ->> 'batch' = %s"


def ended(cluster: Cluster, database: str, batch_id: str) -> int:
    return cluster.sql(
        f"SELECT count(*) FROM k2b_run WHERE {MEMBER} AND status IN ('succeeded', 'failed')",
        [batch_id],
        database=database,
    )[0][0]


def callbacks_done(cluster: Cluster, database: str) -> int:
    return cluster.sql(
        "SELECT count(*) FROM k2b_run"
        " WHERE task_path LIKE 'tests.tasks_app.batched.on_%%' AND status = 'succeeded'",
        database=database,
    )[0][0]


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_batch_drained_through_database_restarts_runs_each_callback_once_after_its_members(
    cluster, database, workers, mode
):
    url = cluster.url(database)
    batch_id = pgcluster.django_script(url, ENQUEUE).strip().splitlines()[-1]
    fleet = [workers(url, "--concurrency", "2") for _ in range(2)]
    for restart, threshold in enumerate((MEMBERS // 4, MEMBERS // 2), 1):
        wait_for(
            lambda threshold=threshold: ended(cluster, database, batch_id) >= threshold,
            timeout=TIMEOUT,
            message=lambda restart=restart: f"before restart {restart}:\n{fleet[0].report()}",
        )
        # Mid-drain: members are left, so the callbacks cannot have been enqueued yet.
        assert ended(cluster, database, batch_id) < MEMBERS
        cluster.restart(mode)
    # Every worker's connections died with the server: each says so, and lives on.
    wait_for(
        lambda: all("database unavailable" in w.output() for w in fleet),
        timeout=TIMEOUT,
        message=lambda: (
            "every worker to notice the restarts:\n" + "\n".join(w.output()[-1500:] for w in fleet)
        ),
    )
    wait_for(
        lambda: callbacks_done(cluster, database) == 2,
        timeout=TIMEOUT,
        message=lambda: "the callbacks:\n" + "\n".join(w.report() for w in fleet),
    )
    for worker in fleet:
        assert worker.proc.poll() is None, worker.output()[-3000:]

    # Each callback that applies was enqueued once (one run each) and called once.
    runs = cluster.sql(
        "SELECT task_path, status, count(*) FROM k2b_run"
        " WHERE task_path LIKE 'tests.tasks_app.batched.on_%%' GROUP BY 1, 2",
        database=database,
    )
    assert sorted(runs) == [
        ("tests.tasks_app.batched.on_failure", "succeeded", 1),
        ("tests.tasks_app.batched.on_finish", "succeeded", 1),
    ]
    calls = cluster.sql(
        "SELECT action, count(*) FROM tests_providercall WHERE effect_key = %s GROUP BY 1",
        [batch_id],
        database=database,
    )
    assert sorted(calls) == [("batch.on_failure", 1), ("batch.on_finish", 1)]
    # After every member: each member had finished when the batch was marked and when
    # its first callback was called.
    (statuses, last_end, fired, outcome, first_call) = cluster.sql(
        f"""SELECT (SELECT array_agg(DISTINCT status ORDER BY status) FROM k2b_run
                     WHERE {MEMBER}),
                   (SELECT max(finished_at) FROM k2b_run WHERE {MEMBER}),
                   b.finished_at, b.outcome,
                   (SELECT min(created_at) FROM tests_providercall WHERE effect_key = %s)
              FROM k2b_task_batch b WHERE b.id = %s""",
        [batch_id, batch_id, batch_id, batch_id],
        database=database,
    )[0]
    assert statuses == ["failed", "succeeded"]
    assert outcome == "failed"
    assert last_end <= fired <= first_call
    assert (
        cluster.sql(f"SELECT count(*) FROM k2b_run WHERE {MEMBER}", [batch_id], database=database)[
            0
        ][0]
        == MEMBERS
    )
