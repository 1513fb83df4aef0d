"""Pure ends committed together (``kernel/together.py``): of tasks, and of workflow runs.

One worker thread executes the claimed runs here, in the test's thread, as a
pool thread of ``runworkflows`` does (``Runner.run_queued``). Which ends shared
a commit is read off the run rows: the rows an end updated carry its
transaction's id (``xmin``).
"""

from __future__ import annotations

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

from k2b_workflows import start_workflow_run
from k2b_workflows.kernel import together
from k2b_workflows.models import WorkflowRun
from k2b_workflows.tasks.names import TASK_APP_ID
from k2b_workflows.worker.loop import Worker
from tests.models import ProviderCall
from tests.tasks_app import tasks as t

try:
    from django.tasks.signals import task_finished
except ImportError:  # Django 5.2: the backport
    from django_tasks.signals import task_finished  # type: ignore[no-redef]

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def unhurried(monkeypatch):
    """No end left alone because the test's machine is slow: what joins a commit is
    decided by the runs, not by the clock."""
    monkeypatch.setattr(together, "QUICK", 60.0)
    monkeypatch.setattr(together, "MAX_WAIT", 60.0)


def _drain_in_one_thread(app_id: str = TASK_APP_ID) -> None:
    worker = Worker(app_ids=[app_id], listen=False)
    runs, loaded, _ = worker.claim(16)
    worker.claims.queue(runs, loaded)
    worker.runner.run_queued()
    assert not worker.claims.ready


def _commits(results) -> list[str]:
    """The transaction that wrote each result's run row last, as a label per commit."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT id::text, xmin::text FROM k2b_run WHERE id = ANY(%s::uuid[])",
            [[str(result.id) for result in results]],
        )
        xmin = dict(cursor.fetchall())
    labels: dict[str, str] = {}
    return [labels.setdefault(xmin[str(result.id)], f"c{len(labels)}") for result in results]


def test_pure_ends_of_one_task_commit_together_and_no_other_end_joins_them():
    finished = []

    def seen(sender, task_result, **kwargs):
        finished.append(task_result.id)

    results = [
        t.add.enqueue(1, 1),
        t.add.enqueue(2, 2),
        t.add.enqueue(3, 3),
        t.pure_crash.enqueue(4),  # pure, another task
        t.charge.enqueue("o-1"),  # external
        t.charge.enqueue("o-2"),
        t.record.enqueue("k-1"),  # idempotent
        t.record.enqueue("k-2"),
        t.add.enqueue(5, 5),
        t.add.enqueue(6, 6),
    ]
    task_finished.connect(seen)
    try:
        _drain_in_one_thread()
    finally:
        task_finished.disconnect(seen)
    assert [WorkflowRun.objects.get(pk=r.id).status for r in results] == ["succeeded"] * 10
    assert [t.add.get_result(r.id).return_value for r in results[:3]] == [2, 4, 6]
    assert sorted(finished) == sorted(str(r.id) for r in results)
    # Three adds in one commit, the next two in another; nothing else shares one.
    assert _commits(results) == ["c0", "c0", "c0", "c1", "c2", "c3", "c4", "c5", "c6", "c6"]
    assert ProviderCall.objects.filter(action="task.charge").count() == 2


def test_a_run_canceled_while_its_end_waits_stays_canceled_and_the_others_end():
    """The canceled run's end no longer matches its row: the batch is refused and rolled
    back, and each run ends on its own, as after a refused end of its own."""
    first = t.cancels.enqueue()
    canceling = t.cancels.enqueue(str(first.id))
    last = t.cancels.enqueue()
    _drain_in_one_thread()
    statuses = [WorkflowRun.objects.get(pk=r.id).status for r in (first, canceling, last)]
    assert statuses == ["canceled", "succeeded", "succeeded"]
    assert ProviderCall.objects.filter(action="task.cancels").count() == 3
    assert _commits([canceling, last]) == ["c0", "c1"]


@override_settings(K2B_WORKFLOWS={**settings.K2B_WORKFLOWS, "PURE_ENDS_TOGETHER": 2})
def test_a_batch_is_no_larger_than_the_setting():
    results = [t.add.enqueue(n, n) for n in range(5)]
    _drain_in_one_thread()
    assert _commits(results) == ["c0", "c0", "c1", "c1", "c2"]


@override_settings(K2B_WORKFLOWS={**settings.K2B_WORKFLOWS, "PURE_ENDS_TOGETHER": 1})
def test_a_setting_of_one_commits_each_end_alone():
    results = [t.add.enqueue(n, n) for n in range(3)]
    _drain_in_one_thread()
    assert _commits(results) == ["c0", "c1", "c2"]


def test_twenty_runs_commit_in_batches_of_eight_by_default():
    results = [t.add.enqueue(n, 1) for n in range(20)]
    worker = Worker(app_ids=[TASK_APP_ID], listen=False)
    runs, loaded, _ = worker.claim(20)
    worker.claims.queue(runs, loaded)
    worker.runner.run_queued()
    labels = _commits(results)
    assert [labels.count(label) for label in dict.fromkeys(labels)] == [8, 8, 4]
    assert [t.add.get_result(r.id).return_value for r in results] == list(range(1, 21))


def test_workflow_runs_whose_ends_are_pure_commit_together_and_an_effects_end_never():
    """A run of pure steps ends with its successes riding on its end: those ends commit
    together, as pure tasks' do. A run whose last step is EXTERNAL commits its own."""
    runs = [start_workflow_run("test.pure", {"a": n, "b": 1}) for n in range(3)]
    runs += [start_workflow_run("test.charge", {"amount": n}) for n in (1, 2)]
    runs += [start_workflow_run("test.pure", {"a": 10, "b": 1})]
    _drain_in_one_thread("tests")
    assert [WorkflowRun.objects.get(pk=r.pk).status for r in runs] == ["succeeded"] * 6
    assert [WorkflowRun.objects.get(pk=r.pk).output for r in runs[:3]] == [
        {"total": n + 2} for n in range(3)
    ]
    assert _commits(runs) == ["c0", "c0", "c0", "c1", "c2", "c3"]
    assert ProviderCall.objects.filter(action="test.charge").count() == 2


def test_the_prefetch_counts_each_runs_time_once(monkeypatch):
    """The runs that joined an end executed inside it: the claim-ahead estimate
    (``Prefetch.ran``) counts their time as theirs, not again as the first run's."""
    import time

    results = [t.add.enqueue(n, 1) for n in range(8)]
    worker = Worker(app_ids=[TASK_APP_ID], listen=False)
    runs, loaded, _ = worker.claim(8)
    worker.claims.queue(runs, loaded)
    counted: list[float] = []
    monkeypatch.setattr(worker.prefetch, "ran", counted.append)
    started = time.monotonic()
    worker.runner.run_queued()
    took = time.monotonic() - started
    assert _commits(results) == ["c0"] * 8
    assert len(counted) == 8
    assert sum(counted) <= took
