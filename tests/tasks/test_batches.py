"""Batches of task calls (#50): each callback runs once when every member has finished,
however the members end, whoever notices, and whatever process dies on the way."""

from __future__ import annotations

import datetime as dt
import io
import json
import signal
import threading
import uuid

import psycopg
import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection, connections
from django.urls import reverse

from k2b_workflows import EFFECT_ABSENT, EFFECT_CONFIRMED, cancel_workflow_run, resolve_effect
from k2b_workflows.kernel import batches
from k2b_workflows.models import TaskBatch, WorkflowRun
from k2b_workflows.retention import purge_finished_runs
from k2b_workflows.tasks import (
    InvalidTaskArguments,
    InvalidTaskCall,
    batch_status,
    enqueue_batch,
)
from k2b_workflows.tasks.compat import tasks_api
from k2b_workflows.testing import crash_after_effect, run_until_idle
from tests.models import ProviderCall
from tests.tasks_app import batched as b

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 90  # generous: the machine is shared; nothing here is a timing assertion
CALLBACKS = {"on_finish": b.on_finish, "on_success": b.on_success, "on_failure": b.on_failure}


def calls(n, failing=()):
    return [((i,), {"fail": i in failing}) for i in range(n)]


def called(batch_id) -> dict[str, int]:
    """How often each callback was called for the batch, by its recorded calls."""
    seen: dict[str, int] = {}
    for action in ProviderCall.objects.filter(effect_key=str(batch_id)).values_list(
        "action", flat=True
    ):
        name = action.removeprefix("batch.")
        seen[name] = seen.get(name, 0) + 1
    return seen


def callback_runs(batch_id) -> dict[str, int]:
    """How many runs each callback has for the batch (whatever their state)."""
    runs: dict[str, int] = {}
    for name in CALLBACKS:
        runs[name] = WorkflowRun.objects.filter(
            task_path=f"tests.tasks_app.batched.{name}",
            input__kwargs__batch_id=str(batch_id),
        ).count()
    return runs


def sweep() -> int:
    """One housekeeping pass over the batches, as a worker makes it."""
    return batches.fire_due("default", batches.due("default"))


def test_every_member_succeeded_on_finish_and_on_success_run_once():
    batch = enqueue_batch(b.member, calls(5), **CALLBACKS)
    assert len(batch.results) == 5
    assert batch_status(batch.id) == (5, 5, 0, 0, 0, None)
    assert called(batch.id) == {}
    run_until_idle()
    assert called(batch.id) == {"on_finish": 1, "on_success": 1}
    status = batch_status(batch.id)
    assert (status.total, status.ready, status.running, status.successful, status.failed) == (
        5,
        0,
        0,
        5,
        0,
    )
    assert status.finished_at is not None
    assert sweep() == 0
    run_until_idle()
    assert callback_runs(batch.id) == {"on_finish": 1, "on_success": 1, "on_failure": 0}
    assert TaskBatch.objects.get(pk=batch.id).outcome == "successful"


def test_a_failed_member_runs_on_finish_and_on_failure_once():
    batch = enqueue_batch(b.member, calls(4, failing={2}), **CALLBACKS)
    run_until_idle()
    assert called(batch.id) == {"on_finish": 1, "on_failure": 1}
    status = batch_status(batch.id)
    assert (status.successful, status.failed) == (3, 1)
    assert TaskBatch.objects.get(pk=batch.id).outcome == "failed"


def test_callbacks_are_optional_and_the_batch_still_finishes():
    batch = enqueue_batch(b.member, calls(2))
    run_until_idle()
    assert batch_status(batch.id).finished_at is not None
    assert TaskBatch.objects.get(pk=batch.id).callback_runs == {}


def test_no_callback_while_a_member_needs_an_operator_and_once_it_is_resolved():
    """A member whose outcome is unknown has not finished: the batch waits for the
    operator's decision, then runs its callbacks once."""
    batch = enqueue_batch(b.external_member, [((1,), {}), ((2,), {})], **CALLBACKS)
    with crash_after_effect(b.external_member):
        run_until_idle()
    stuck = [r.id for r in batch.results if WorkflowRun.objects.get(pk=r.id).status != "succeeded"]
    assert len(stuck) == 1
    assert WorkflowRun.objects.get(pk=stuck[0]).status == "needs_attention"
    status = batch_status(batch.id)
    assert (status.running, status.successful, status.finished_at) == (1, 1, None)
    assert batches.due("default") == []
    assert batches.fire("default", batch.id) is False
    run_until_idle()
    assert called(batch.id) == {}
    operator = get_user_model().objects.create_superuser("op", "op@example.com", "pw")
    resolve_effect(
        stuck[0], EFFECT_CONFIRMED, evidence="the provider shows it", actor=operator, output=None
    )
    run_until_idle()
    assert called(batch.id) == {"on_finish": 1, "on_success": 1}
    run_until_idle()
    assert callback_runs(batch.id) == {"on_finish": 1, "on_success": 1, "on_failure": 0}


def stuck_member(batch) -> uuid.UUID:
    """Run the batch with a crash after the first external call's effect: its member."""
    with crash_after_effect(b.external_member):
        run_until_idle()
    (stuck,) = WorkflowRun.objects.filter(
        pk__in=[r.id for r in batch.results], status="needs_attention"
    ).values_list("pk", flat=True)
    return stuck


def test_a_member_found_absent_runs_again_and_holds_the_callbacks_until_its_new_end():
    batch = enqueue_batch(b.external_member, [((1,), {}), ((2,), {})], **CALLBACKS)
    stuck = stuck_member(batch)
    operator = get_user_model().objects.create_superuser("op", "op@example.com", "pw")
    resolve_effect(stuck, EFFECT_ABSENT, evidence="the provider has no trace", actor=operator)
    assert WorkflowRun.objects.get(pk=stuck).status == "queued"
    assert sweep() == 0
    assert batch_status(batch.id).finished_at is None
    run_until_idle()
    assert WorkflowRun.objects.get(pk=stuck).status == "succeeded"
    assert called(batch.id) == {"on_finish": 1, "on_success": 1}


def test_a_member_canceled_by_the_operator_failed_on_finish_and_on_failure_run():
    batch = enqueue_batch(b.external_member, [((1,), {}), ((2,), {})], **CALLBACKS)
    stuck = stuck_member(batch)
    cancel_workflow_run(stuck, reason="the customer withdrew")
    run_until_idle()
    assert called(batch.id) == {"on_finish": 1, "on_failure": 1}
    assert TaskBatch.objects.get(pk=batch.id).outcome == "failed"


def test_two_detectors_at_once_enqueue_each_callback_once(monkeypatch):
    """Two passes fire the same finished batch at the same moment: one enqueues."""
    batch = enqueue_batch(b.member, calls(3), **CALLBACKS)
    with monkeypatch.context() as patched:  # members run by a worker that sees no batch
        patched.setattr(batches, "due", lambda using, limit=100: [])
        run_until_idle()
    assert batches.due("default") == [batch.id]
    barrier = threading.Barrier(2)
    fired: list[bool] = []

    def detector():
        try:
            barrier.wait(timeout=10)
            fired.append(batches.fire("default", batch.id))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=detector) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(fired) == [False, True]
    assert callback_runs(batch.id) == {"on_finish": 1, "on_success": 1, "on_failure": 0}


def test_a_finished_mark_cleared_by_hand_enqueues_no_callback_again():
    """The runtime role can write the batch row: a cleared mark makes the next pass fire
    again, and the callbacks' idempotency keys (a unique constraint) insert nothing."""
    batch = enqueue_batch(b.member, calls(2), **CALLBACKS)
    run_until_idle()
    first = TaskBatch.objects.get(pk=batch.id).callback_runs
    TaskBatch.objects.filter(pk=batch.id).update(finished_at=None)
    assert sweep() == 1
    assert callback_runs(batch.id) == {"on_finish": 1, "on_success": 1, "on_failure": 0}
    assert TaskBatch.objects.get(pk=batch.id).callback_runs == first
    run_until_idle()
    assert called(batch.id) == {"on_finish": 1, "on_success": 1}


def test_a_callback_changed_in_the_batch_row_is_refused(caplog):
    batch = enqueue_batch(b.member, calls(1), on_finish=b.on_finish)
    row = TaskBatch.objects.get(pk=batch.id)
    row.callbacks["on_finish"]["input"]["kwargs"]["batch_id"] = str(uuid.uuid4())
    row.save(update_fields=["callbacks"])
    run_until_idle()
    assert callback_runs(batch.id)["on_finish"] == 0
    assert TaskBatch.objects.get(pk=batch.id).outcome == "refused"
    assert caplog.text.count("does not match its seal") == 1
    assert sweep() == 0


def test_batch_status_counts_members_by_state():
    batch = enqueue_batch(b.member, calls(3, failing={0}))
    assert batch_status(batch.id) == (3, 3, 0, 0, 0, None)
    run_until_idle()
    status = batch_status(batch.id)
    assert status[:5] == (3, 0, 0, 2, 1)
    assert status.finished_at is not None


# -- retention --------------------------------------------------------------------------

MONTH = dt.timedelta(days=30)


def age(batch_id=None, runs=(), days: int = 40) -> None:
    """Pretend the runs (and the batch's callbacks' enqueue) ended ``days`` ago."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE k2b_run SET finished_at = finished_at - %s WHERE id = ANY(%s)",
            [dt.timedelta(days=days), list(runs)],
        )
        cursor.execute(
            "UPDATE k2b_task_batch SET finished_at = finished_at - %s WHERE id = %s",
            [dt.timedelta(days=days), batch_id],
        )


def members_and_callbacks(batch):
    row = TaskBatch.objects.get(pk=batch.id)
    return [uuid.UUID(r.id) for r in batch.results], [
        uuid.UUID(v) for v in row.callback_runs.values()
    ]


def test_a_finished_batch_goes_with_its_members_and_its_callbacks_runs():
    batch = enqueue_batch(b.member, calls(3, failing={1}), **CALLBACKS)
    run_until_idle()
    members, callbacks = members_and_callbacks(batch)
    assert len(callbacks) == 2
    age(batch.id, [*members, *callbacks])

    counted = purge_finished_runs(older_than=MONTH, dry_run=True)
    assert (counted["run trees"], counted["task batches"]) == (5, 1)
    assert TaskBatch.objects.exists()

    purged = purge_finished_runs(older_than=MONTH)
    assert (purged["run trees"], purged["task batches"]) == (5, 1)
    assert not TaskBatch.objects.exists()
    assert not WorkflowRun.objects.exists()


@pytest.mark.parametrize("left", ["a member", "a callback's run"])
def test_a_batch_stays_while_one_of_its_runs_is_left(left):
    """A member or callback's run that is recent (or not finished) is not purged, and
    keeps its batch: the admin shows a batch with its members and callbacks' runs."""
    batch = enqueue_batch(b.member, calls(3), **CALLBACKS)
    run_until_idle()
    members, callbacks = members_and_callbacks(batch)
    recent = members[0] if left == "a member" else callbacks[0]
    age(batch.id, [r for r in [*members, *callbacks] if r != recent])

    purged = purge_finished_runs(older_than=MONTH)
    assert (purged["run trees"], purged["task batches"]) == (4, 0)
    assert TaskBatch.objects.filter(pk=batch.id).exists()
    assert list(WorkflowRun.objects.values_list("pk", flat=True)) == [recent]

    age(runs=[recent])
    purged = purge_finished_runs(older_than=MONTH)
    assert (purged["run trees"], purged["task batches"]) == (1, 1)
    assert not TaskBatch.objects.exists()


def test_members_of_a_batch_whose_callbacks_wait_are_kept_whatever_their_age(monkeypatch):
    """Purged before its callbacks were enqueued, a failed member would leave a batch
    that looks successful: its members stay until the batch has finished."""
    batch = enqueue_batch(b.member, calls(3, failing={2}), **CALLBACKS)
    with monkeypatch.context() as patched:  # members run by a worker that sees no batch
        patched.setattr(batches, "due", lambda using, limit=100: [])
        run_until_idle()
    members = [r.id for r in batch.results]
    age(runs=members)

    purged = purge_finished_runs(older_than=MONTH)
    assert (purged["run trees"], purged["task batches"]) == (0, 0)
    assert WorkflowRun.objects.count() == 3
    assert TaskBatch.objects.filter(pk=batch.id, finished_at=None).exists()

    assert sweep() == 1
    assert TaskBatch.objects.get(pk=batch.id).outcome == "failed"
    run_until_idle()
    assert called(batch.id) == {"on_finish": 1, "on_failure": 1}


def test_a_batch_id_that_is_not_a_uuid_in_a_row_does_not_stop_the_purge():
    """The runtime role can write runs' inputs and batch rows: a value that is not a
    uuid names no batch and no run, rather than failing every purge with a cast error."""
    batch = enqueue_batch(b.member, calls(2), on_finish=b.on_finish)
    run_until_idle()
    members, callbacks = members_and_callbacks(batch)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE k2b_run SET input = jsonb_set(input, '{batch}', '\"nope\"') WHERE id = %s",
            [members[0]],
        )
    TaskBatch.objects.filter(pk=batch.id).update(callback_runs={"on_finish": "nope"})
    age(batch.id, [*members, *callbacks])
    waiting = enqueue_batch(b.member, calls(1))  # an open batch: members are looked up
    purged = purge_finished_runs(older_than=MONTH)
    assert (purged["run trees"], purged["task batches"]) == (3, 1)
    assert list(TaskBatch.objects.values_list("pk", flat=True)) == [waiting.id]


def test_purgeworkflows_deletes_finished_batches():
    batch = enqueue_batch(b.member, calls(2), on_finish=b.on_finish)
    run_until_idle()
    members, callbacks = members_and_callbacks(batch)
    age(batch.id, [*members, *callbacks])
    out = io.StringIO()
    call_command("purgeworkflows", "--older-than-days", "30", stdout=out)
    assert "3 run trees" in out.getvalue() and "1 task batches" in out.getvalue()
    assert not TaskBatch.objects.exists()


# -- bad input ------------------------------------------------------------------------


def test_an_empty_batch_is_refused(nothing_inserted):
    with pytest.raises(InvalidTaskCall, match="calls is empty"):
        enqueue_batch(b.member, [], on_finish=b.on_finish)
    assert not TaskBatch.objects.exists()


@pytest.mark.parametrize(
    ("callback", "message"),
    [
        (b.member.func, "on_success must be a task made with @task, not the plain function"),
        ("tests.tasks_app.batched.on_success", "on_success must be a task made with @task"),
        (42, "on_success must be a task made with @task, not int"),
    ],
)
def test_a_callback_that_is_not_a_task_is_refused(nothing_inserted, callback, message):
    with pytest.raises(InvalidTaskCall, match=message):
        enqueue_batch(b.member, calls(2), on_success=callback)
    assert not TaskBatch.objects.exists()


@pytest.mark.parametrize("argument", ["task", "on_finish"])
def test_a_task_on_another_backend_is_refused_as_member_or_callback(
    nothing_inserted, settings, argument
):
    settings.TASKS = {
        **settings.TASKS,
        # Django's own dummy backend (6.0 and later), else the backport's.
        "elsewhere": {"BACKEND": f"{tasks_api.__name__}.backends.dummy.DummyBackend"},
    }
    foreign = b.takes_no_batch_id.using(backend="elsewhere")
    given = {"task": b.member, "on_finish": b.on_finish, argument: foreign}
    with pytest.raises(
        InvalidTaskCall,
        match=rf"enqueue_batch\(\): {argument} .*takes_no_batch_id is on backend 'elsewhere' "
        r"\(DummyBackend\), not a k2b_workflows.tasks.WorkflowsBackend",
    ):
        enqueue_batch(given["task"], calls(2), on_finish=given["on_finish"])
    assert not TaskBatch.objects.exists()


def test_a_member_task_that_is_not_a_task_is_refused(nothing_inserted):
    with pytest.raises(
        InvalidTaskCall, match="enqueue_batch\\(\\): task must be a task made with @task"
    ):
        enqueue_batch(b.member.func, calls(2), on_finish=b.on_finish)
    assert not TaskBatch.objects.exists()


def test_a_callback_that_does_not_take_batch_id_is_refused(nothing_inserted):
    with pytest.raises(InvalidTaskArguments, match=r"on_finish .*takes_no_batch_id.* batch_id"):
        enqueue_batch(b.member, calls(2), on_finish=b.takes_no_batch_id)
    assert not TaskBatch.objects.exists()


def test_a_bad_member_call_inserts_nothing(nothing_inserted):
    with pytest.raises(InvalidTaskArguments):
        enqueue_batch(b.member, [((1,), {}), ((1, 2, 3, 4), {})], on_finish=b.on_finish)
    assert not TaskBatch.objects.exists()


def test_batch_status_of_no_batch_is_refused():
    with pytest.raises(InvalidTaskCall, match="no batch"):
        batch_status(uuid.uuid4())
    with pytest.raises(InvalidTaskCall, match="not a batch id"):
        batch_status("nope")


# -- the admin ------------------------------------------------------------------------


def test_the_admin_shows_a_batch_its_members_and_its_callbacks_runs(admin_client):
    batch = enqueue_batch(b.member, calls(3, failing={1}), **CALLBACKS)
    run_until_idle()
    listing = admin_client.get(reverse("admin:k2b_workflows_taskbatch_changelist"))
    assert listing.status_code == 200
    assert str(batch.id) in listing.content.decode()
    page = admin_client.get(reverse("admin:k2b_workflows_taskbatch_change", args=[batch.id]))
    assert page.status_code == 200
    html = page.content.decode()
    runs = TaskBatch.objects.get(pk=batch.id).callback_runs
    assert set(runs) == {"on_finish", "on_failure"}
    for run_id in runs.values():
        assert reverse("admin:k2b_workflows_workflowrun_change", args=[run_id]) in html
    for result in batch.results:
        assert reverse("admin:k2b_workflows_workflowrun_change", args=[result.id]) in html
    members = admin_client.get(
        reverse("admin:k2b_workflows_workflowrun_changelist") + f"?batch={batch.id}"
    )
    assert members.status_code == 200
    assert html.count("tests.tasks_app.batched.member") >= 1


# -- real workers ---------------------------------------------------------------------


def killed(worker) -> None:
    code = worker.wait(timeout=TIMEOUT)
    assert code == -signal.SIGKILL, f"worker exited {code}:\n{worker.output()}"


@pytest.mark.crash
def test_last_members_ending_together_on_two_workers_run_each_callback_once(start_worker, wait):
    batch = enqueue_batch(b.member, calls(60, failing={7}), **CALLBACKS)
    workers = [start_worker("--concurrency", "3") for _ in range(2)]
    wait(
        lambda: (
            called(batch.id) == {"on_finish": 1, "on_failure": 1}
            and WorkflowRun.objects.filter(
                task_path__startswith="tests.tasks_app.batched.on_", status="succeeded"
            ).count()
            == 2
        ),
        timeout=TIMEOUT,
        message=lambda: f"the callbacks: {called(batch.id)}\n{workers[0].report()}",
    )
    assert sweep() == 0
    assert callback_runs(batch.id) == {"on_finish": 1, "on_success": 0, "on_failure": 1}
    assert called(batch.id) == {"on_finish": 1, "on_failure": 1}


@pytest.mark.crash
def test_a_worker_killed_after_the_last_end_before_the_callbacks_is_made_good(start_worker, wait):
    """The batch row is held (as by a pass in flight) while the worker ends every member;
    the worker is killed then: the next worker enqueues the callbacks, once."""
    batch = enqueue_batch(b.member, calls(4), **CALLBACKS)
    dsn = connection.get_connection_params()
    with psycopg.connect(**dsn) as holder:
        holder.execute("SELECT 1 FROM k2b_task_batch WHERE id = %s FOR UPDATE", [batch.id])
        dying = start_worker("--concurrency", "2")
        wait(
            lambda: batch_status(batch.id).successful == 4,
            timeout=TIMEOUT,
            message=lambda: dying.report(),
        )
        assert callback_runs(batch.id) == {"on_finish": 0, "on_success": 0, "on_failure": 0}
        dying.signal(signal.SIGKILL)
        killed(dying)
        holder.rollback()
    healthy = start_worker("--concurrency", "2")
    wait(
        lambda: called(batch.id) == {"on_finish": 1, "on_success": 1},
        timeout=TIMEOUT,
        message=lambda: f"the callbacks: {called(batch.id)}\n{healthy.report()}",
    )
    assert callback_runs(batch.id) == {"on_finish": 1, "on_success": 1, "on_failure": 0}


@pytest.mark.crash
def test_a_worker_killed_inside_a_callback_enqueues_it_no_second_time(start_worker, wait):
    """Killed once the callbacks were enqueued (inside the first to run): the callback's
    run is taken over as any run's is, and no pass enqueues another."""
    batch = enqueue_batch(b.member, calls(3), on_finish=b.on_finish, on_success=b.on_success)
    dying = start_worker("--concurrency", "1", env={"K2B_TEST_CRASH": "batch_callback"})
    killed(dying)
    assert sum(callback_runs(batch.id).values()) == 2
    healthy = start_worker("--concurrency", "2")
    wait(
        lambda: (
            WorkflowRun.objects.filter(
                task_path__startswith="tests.tasks_app.batched.on_", status="succeeded"
            ).count()
            == 2
        ),
        timeout=TIMEOUT,
        message=lambda: f"the callbacks: {called(batch.id)}\n{healthy.report()}",
    )
    assert callback_runs(batch.id) == {"on_finish": 1, "on_success": 1, "on_failure": 0}
    assert sweep() == 0
    # The killed callback ran again on the healthy worker: its call, not a new run.
    assert set(called(batch.id)) == {"on_finish", "on_success"}


@pytest.mark.crash
def test_a_member_needing_attention_holds_the_callbacks_until_it_is_resolved(start_worker, wait):
    batch = enqueue_batch(
        b.external_member, [((1,), {}), ((2,), {"crash": "batch_member"})], **CALLBACKS
    )
    stuck = batch.results[1].id
    killed(start_worker("--concurrency", "1", env={"K2B_TEST_CRASH": "batch_member"}))
    healthy = start_worker("--concurrency", "2")
    wait(
        lambda: (
            WorkflowRun.objects.get(pk=stuck).status == "needs_attention"
            and batch_status(batch.id).successful == 1
        ),
        timeout=TIMEOUT,
        message=lambda: healthy.report(),
    )
    assert batch_status(batch.id).running == 1
    assert sweep() == 0
    assert called(batch.id) == {}
    assert batch_status(batch.id).finished_at is None
    operator = get_user_model().objects.create_superuser("op", "op@example.com", "pw")
    resolve_effect(
        stuck, EFFECT_CONFIRMED, evidence="the provider shows it", actor=operator, output=None
    )
    wait(
        lambda: called(batch.id) == {"on_finish": 1, "on_success": 1},
        timeout=TIMEOUT,
        message=lambda: f"the callbacks: {called(batch.id)}\n{healthy.report()}",
    )
    assert callback_runs(batch.id) == {"on_finish": 1, "on_success": 1, "on_failure": 0}


@pytest.mark.crash
def test_a_burst_worker_enqueues_and_runs_the_callbacks_of_the_batch_it_drained(
    start_worker,
):
    """A ``--burst`` worker leaves once nothing is left: not before a last pass has
    enqueued the callbacks of the batch whose last member it ended."""
    batch = enqueue_batch(b.member, [((1,), {"seconds": 0.2})], on_finish=b.on_finish)
    # A long poll: the housekeeping's passes are half a second apart. The member ends
    # after the pass of the loop's turn that claimed it (it sleeps) and before the
    # next pass is due, so only a last pass before leaving finds the batch.
    worker = start_worker(
        "--burst",
        "--concurrency",
        "1",
        env={"K2B_TEST_SETTINGS": json.dumps({"POLL_INTERVAL_MS": 5000})},
    )
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()
    assert called(batch.id) == {"on_finish": 1}


def test_a_task_declaring_unique_is_refused_by_enqueue_batch_and_nothing_is_inserted():
    from k2b_workflows.tasks import InvalidTaskCall
    from tests.tasks_app import unique as unique_tasks

    with pytest.raises(InvalidTaskCall, match="declares unique"):
        enqueue_batch(unique_tasks.rebuild_index, [((1,), None)], on_finish=b.on_finish)
    assert not WorkflowRun.objects.exists()
    assert not TaskBatch.objects.exists()
