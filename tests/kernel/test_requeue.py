"""Every re-queue of a run takes its SET clause from one builder (kernel/requeue.py)."""

from __future__ import annotations

import pytest

from k2b_workflows.kernel import claim, ending, flow, interventions, waits
from k2b_workflows.kernel.requeue import requeue_set

#: Every statement that puts a run back in the queue, and whether a worker held the run.
REQUEUES = {
    "an expired lease": (claim._REAP_SQL, True),
    "a due wait": (claim._PROMOTE_SQL, False),
    "a release": (claim._RELEASE_SQL, True),
    "a hand-back": (claim._HAND_BACK_SQL, True),
    "an orphan": (claim._ORPHANS_SQL, True),
    "a retry": (ending.RETRY_LATER_SQL, True),
    "an operator's retry": (interventions.REQUEUE_SQL, False),
    "a deferral": (flow._DEFER_SQL, True),
    "a wake before parking": (waits._WOKEN_BEFORE_PARKING_SQL, False),
    "a wake": (waits._WAKE_SQL, False),
}


@pytest.mark.parametrize("case", REQUEUES)
def test_every_requeue_sets_the_status_when_and_its_time_and_a_held_run_loses_its_holder(case):
    statement, held = REQUEUES[case]
    assert "status = 'queued'" in statement
    assert "run_after = " in statement
    assert "updated_at = k2b_now()" in statement
    assert ("claimed_by = ''" in statement) is held
    if held:
        assert "lease_expires_at = NULL" in statement


def test_a_requeue_without_when_the_run_is_due_is_refused():
    with pytest.raises(TypeError, match="run_after"):
        requeue_set(release=True, consecutive_failures="0")


def test_a_requeue_may_not_set_what_the_builder_sets():
    with pytest.raises(TypeError, match="claimed_by"):
        requeue_set(release=True, run_after="k2b_now()", claimed_by="'x'")
    with pytest.raises(TypeError, match="status"):
        requeue_set(release=False, run_after="k2b_now()", status="'running'")


def test_the_columns_keep_their_order_for_their_parameters():
    assert requeue_set(release=False, a="%s", run_after="k2b_now() + %s", b="%s") == (
        "status = 'queued', a = %s, run_after = k2b_now() + %s, b = %s, updated_at = k2b_now()"
    )
