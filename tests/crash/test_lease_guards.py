"""The lease holder's guards, each bitten by a test of its own (#30).

A review removed the generation check from the lease keeper's renewal, and
the ``claimed_by`` check from the orphan hand-back, and the whole suite
still passed. Without the first, a worker that lost its run to a takeover
keeps renewing the new holder's lease (the run can no longer be taken over
if that holder dies) and never tells its own action to stop. Without the
second, a worker queues again the runs other workers are executing.
"""

from __future__ import annotations

import threading

import pytest

from k2b_workflows import start_workflow_run
from k2b_workflows.kernel import claim, db
from k2b_workflows.kernel.leases import LeaseKeeper
from k2b_workflows.models import WorkflowRun

pytestmark = pytest.mark.django_db(transaction=True)


def _claim(worker_id: str) -> tuple[object, int]:
    ((run_id, generation),) = claim.claim_runs(
        "default", worker_id=worker_id, workflows=[("test.pure", 1)], app_ids=None, limit=1
    )
    return run_id, generation


def test_a_keeper_that_lost_its_run_to_a_takeover_does_not_renew_it_and_stops_its_action():
    start_workflow_run("test.pure", {"a": 1, "b": 1})
    run_id, generation = _claim("stale")
    # Another worker takes the run over: same status, a higher generation.
    db.execute(
        "default",
        """UPDATE k2b_run SET generation = generation + 1, claimed_by = 'new',
                  lease_expires_at = k2b_now() + interval '1 second' WHERE id = %s""",
        [run_id],
    )
    before = WorkflowRun.objects.get(pk=run_id).lease_expires_at
    aborted = threading.Event()
    keeper = LeaseKeeper("default")
    keeper.track(run_id, generation, aborted)
    try:
        keeper.tick(renew=True)
    finally:
        keeper.stop()
    assert WorkflowRun.objects.get(pk=run_id).lease_expires_at == before
    assert aborted.is_set()  # ctx.canceled: the stale action is told to stop


def test_a_keeper_renews_the_run_it_holds():
    start_workflow_run("test.pure", {"a": 1, "b": 1})
    run_id, generation = _claim("holder")
    db.execute(
        "default",
        "UPDATE k2b_run SET lease_expires_at = k2b_now() + interval '1 second' WHERE id = %s",
        [run_id],
    )
    before = WorkflowRun.objects.get(pk=run_id).lease_expires_at
    held = threading.Event()
    keeper = LeaseKeeper("default")
    keeper.track(run_id, generation, held)
    try:
        keeper.tick(renew=True)
    finally:
        keeper.stop()
    assert WorkflowRun.objects.get(pk=run_id).lease_expires_at > before
    assert not held.is_set()


def test_the_orphan_hand_back_queues_only_this_workers_runs():
    start_workflow_run("test.pure", {"a": 1, "b": 1})
    start_workflow_run("test.pure", {"a": 2, "b": 2})
    mine, _ = _claim("me")
    theirs, _ = _claim("them")
    assert claim.hand_back_orphans("default", "me", executing=[]) == 1
    statuses = dict(WorkflowRun.objects.filter(pk__in=[mine, theirs]).values_list("pk", "status"))
    assert statuses == {mine: "queued", theirs: "running"}


def test_the_orphan_hand_back_leaves_the_runs_this_worker_executes():
    start_workflow_run("test.pure", {"a": 1, "b": 1})
    run_id, _ = _claim("me")
    assert claim.hand_back_orphans("default", "me", executing=[run_id]) == 0
    assert WorkflowRun.objects.get(pk=run_id).status == "running"


def test_a_reaper_counts_no_failure_for_its_own_run_and_one_for_a_dead_workers():
    """The reaping worker is alive: a lease of its own that its keeper renewed too late
    was not lost to a crash (#38). A holder with no heartbeat since is presumed dead."""
    start_workflow_run("test.pure", {"a": 1, "b": 1})
    start_workflow_run("test.pure", {"a": 2, "b": 2})
    own, _ = _claim("reaper")
    dead, _ = _claim("dead")
    db.execute(
        "default",
        "UPDATE k2b_run SET lease_expires_at = k2b_now() - interval '1 second' WHERE id = ANY(%s)",
        [[own, dead]],
    )
    assert claim.reap_expired("default", "reaper") == 2
    mine, theirs = WorkflowRun.objects.get(pk=own), WorkflowRun.objects.get(pk=dead)
    assert (mine.status, mine.consecutive_failures, mine.claimed_by) == ("queued", 0, "")
    assert mine.error_message.startswith("lease lost by a live worker"), mine.error_message
    assert (theirs.status, theirs.consecutive_failures) == ("queued", 1)
    assert theirs.error_message.startswith("lease expired"), theirs.error_message


def _expire(*run_ids: object) -> None:
    db.execute(
        "default",
        "UPDATE k2b_run SET lease_expires_at = k2b_now() - interval '1 second' WHERE id = ANY(%s)",
        [list(run_ids)],
    )


def test_a_reaper_leaves_the_runs_it_executes_in_time_to_its_keeper():
    start_workflow_run("test.pure", {"a": 1, "b": 1})
    run_id, generation = _claim("reaper")
    _expire(run_id)
    assert claim.reap_expired("default", "reaper", [run_id]) == 0
    held = WorkflowRun.objects.get(pk=run_id)
    assert (held.status, held.generation, held.claimed_by) == ("running", generation, "reaper")
    # Another worker takes it over as ever: the fence does not depend on who reaps.
    assert claim.reap_expired("default", "other") == 1
    assert WorkflowRun.objects.get(pk=run_id).status == "queued"


def test_a_second_live_loss_at_the_same_step_counts_so_a_too_short_lease_still_exhausts():
    start_workflow_run("test.pure", {"a": 1, "b": 1})
    losses = []
    for _ in range(3):
        db.execute("default", "UPDATE k2b_run SET run_after = k2b_now() - interval '1 second'")
        run_id, _ = _claim("reaper")
        _expire(run_id)
        assert claim.reap_expired("default", "reaper") == 1
        run = WorkflowRun.objects.get(pk=run_id)
        losses.append((run.consecutive_failures, run.error_message.split(" (")[0][:40]))
    assert [failures for failures, _ in losses] == [0, 1, 2], losses
