"""A task canceled while its call runs, under a real ``runworkflows`` (#51).

An end at once (``control.cancel_run``, as a timeout ends a run; ``cancel`` and
``cancel_workflow_run`` only ask a running call, #49) does not cut the call, and it
returns later into a run that is no longer its worker's. That late end must be
refused by the run's fence, in one clear line, and never sent to the database as an
end for it to reject: the canceled run stays as the cancel left it, its chains
verify, an external call's answer is kept as late evidence, and the worker goes on.
"""

from __future__ import annotations

import re

import pytest

from k2b_workflows.control import cancel_run
from k2b_workflows.models import LedgerEntry, WorkflowRun
from tests.models import ProviderCall
from tests.support.misuse import verify
from tests.tasks_app import held as h
from tests.tasks_app import tasks as t

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TIMEOUT = 90  # generous: the machine is shared; nothing here is a timing assertion

#: What the database says when a statement it was sent breaks a constraint: a late end
#: the fence should have refused before any such statement was sent.
DATABASE_ERROR = re.compile(r"violates|null value|refused \(|Traceback", re.IGNORECASE)


def _canceled_under_its_call(start_worker, wait, task, key: str):
    """Enqueue ``task(key)`` on one worker thread, cancel its run while the call is
    inside, release the call, and wait until the worker ran the next task: returns the
    canceled run, the next task's result and the worker."""
    worker = start_worker("--concurrency", "1")
    result = task.enqueue(key)
    wait(
        lambda: ProviderCall.objects.filter(action="held.started", effect_key=key).exists(),
        timeout=TIMEOUT,
        message=lambda: f"the call {key} to start:\n{worker.report()}",
    )
    canceled = cancel_run(result.id, "not wanted any more")
    assert canceled.status == "canceled"
    h.release(key)
    following = t.add.enqueue(20, 22)
    # One worker thread: the next task runs only once the canceled call has returned
    # and its late end was dealt with.
    wait(
        lambda: WorkflowRun.objects.get(pk=following.id).status == "succeeded",
        timeout=TIMEOUT,
        message=lambda: f"the next task to succeed:\n{worker.report()}",
    )
    return WorkflowRun.objects.get(pk=result.id), following, worker


def _assert_refused_cleanly(run: WorkflowRun, worker) -> None:
    log = worker.output()
    assert (run.status, run.error_code) == ("canceled", "CANCELED"), log
    assert run.output is None, log
    assert not DATABASE_ERROR.search(log), log
    # One line says what became of the call's result.
    assert f"run {run.pk} was canceled while its step ran" in log, log
    assert "FAILED" not in verify(), verify()


def test_a_pure_task_canceled_under_its_call_ends_nothing_and_the_worker_goes_on(
    start_worker, wait
):
    run, following, worker = _canceled_under_its_call(start_worker, wait, h.held, "pure-1")
    _assert_refused_cleanly(run, worker)
    assert run.journal.count() == 0  # a PURE result is not evidence
    assert list(run.ledger.values_list("kind", flat=True)) == ["canceled"]
    assert t.add.get_result(following.id).return_value == 42


def test_an_external_task_canceled_under_its_call_keeps_its_answer_as_late_evidence(
    start_worker, wait
):
    run, following, worker = _canceled_under_its_call(
        start_worker, wait, h.held_charge, "external-1"
    )
    _assert_refused_cleanly(run, worker)
    assert ProviderCall.objects.filter(action="held.charged", effect_key="external-1").count() == 1
    assert run.journal.count() == 0
    kinds = list(run.ledger.order_by("id").values_list("kind", flat=True))
    assert kinds == ["dispatched", "canceled", "late_result"], kinds
    late = run.ledger.get(kind=LedgerEntry.Kind.LATE_RESULT)
    assert late.detail["outcome"] == "succeeded"
    assert late.output_hash  # the answer's hash, its redacted summary in detail
    assert t.add.get_result(following.id).return_value == 42
