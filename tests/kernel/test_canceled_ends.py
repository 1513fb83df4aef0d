"""A run canceled, or taken over, while its last step ran: the claim's late end (#51).

A cancel that ends the run at once (``control.cancel_run``, as a timeout does:
``cancel_workflow_run`` only asks a running run, #49) does not cut the step's call:
when it returns, its claim still holds a result and an end to write, for a run that
is no longer its own. That end is refused by the fence once, said in one line, the
result kept as late evidence where the kernel keeps one; it is not tried again
another way (as read, then statement by statement) for the database to refuse each
time.

Each test claims a run as a worker does and ends it directly (``RunEnding``), as
``test_run_ending.py`` does; what the end sends is counted by spying on the
kernel's ways of writing it.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from k2b_workflows import start_workflow_run, succeeded
from k2b_workflows.control import cancel_run
from k2b_workflows.exceptions import LeaseLost, RunCanceled
from k2b_workflows.kernel import db, evidence
from k2b_workflows.kernel.ending import Outcome, RunEnding
from k2b_workflows.models import LedgerEntry, WorkflowRun
from tests.support.kernel import (
    claimed_execution,
    fresh,
    journal,
    ledger_kinds,
    new_step,
    take_over,
)
from tests.support.misuse import verify
from tests.workflows.units import UnitExternal, UnitPure

pytestmark = pytest.mark.django_db(transaction=True)

DISPATCHED = LedgerEntry.Kind.DISPATCHED
SUCCEEDED = LedgerEntry.Kind.SUCCEEDED
#: What the database says of a strict write it refused: never the worker's to log.
REFUSAL_TEXTS = ("null value", "violates", "refused (")


def _started() -> tuple[WorkflowRun, Any]:
    run = start_workflow_run("units.plain", {"n": 0})
    return run, claimed_execution(run)


def _pending_success(execution: Any, *, external: bool) -> None:
    """Step 0's success, deferred as the journal defers it (an external one after its
    dispatch committed): what the claim holds when the step's call returns."""
    j = execution.journal
    if external:
        step = new_step(execution, 0, UnitExternal, invocation=1)
        j.ledger_event(step, DISPATCHED, fenced=True)
        j.journal_success(step, succeeded({"sent": True}), ledger_kind=SUCCEEDED)
    else:
        j.journal_success(new_step(execution, 0, UnitPure), succeeded({"n": 1}))


@pytest.fixture
def sent(monkeypatch) -> list[str]:
    """What the end tried, in order: each batch sent (``db.commit_batch``), each end as
    read and each fenced transition."""
    tried: list[str] = []

    def spy(name: str, real: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tried.append(name)
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(db, "commit_batch", spy("batch", db.commit_batch))
    monkeypatch.setattr(RunEnding, "end_as_read", spy("as_read", RunEnding.end_as_read))
    monkeypatch.setattr(RunEnding, "transition", spy("transition", RunEnding.transition))
    return tried


def _no_database_refusal_logged(caplog) -> None:
    for record in caplog.records:
        message = record.getMessage()
        assert not any(text in message for text in REFUSAL_TEXTS), message


@pytest.mark.parametrize("external", [False, True], ids=["pure", "external"])
def test_the_late_end_of_a_canceled_run_is_refused_once_and_says_what_became_of_the_result(
    external, sent, caplog
):
    caplog.set_level(logging.INFO, logger="k2b_workflows")
    run, execution = _started()
    _pending_success(execution, external=external)
    cancel_run(run.pk, "not wanted any more")
    canceled = fresh(run)

    with pytest.raises(RunCanceled) as raised:
        execution.ending.succeed({"n": 1})
    what = (
        "its result is recorded as late evidence, not as the run's end"
        if external
        else "its result is dropped, not written as the run's end"
    )
    assert str(raised.value) == f"run {run.pk} was canceled while its step ran: {what}"
    # The end as written, refused by its fence; then nothing more for the database to refuse.
    assert sent == ["batch"]
    _no_database_refusal_logged(caplog)

    after = fresh(run)
    assert (after.status, after.error_code, after.output) == ("canceled", "CANCELED", None)
    assert (after.end_seal, after.updated_at) == (canceled.end_seal, canceled.updated_at)
    assert journal(run) == []
    if external:
        assert ledger_kinds(run) == ["dispatched", "canceled", "late_result"]
        late = LedgerEntry.objects.get(run=run, kind=LedgerEntry.Kind.LATE_RESULT)
        assert late.output_hash == evidence.hash_value({"sent": True})
        assert late.detail["outcome"] == "succeeded"
    else:
        assert ledger_kinds(run) == ["canceled"]
    assert execution.outcome == Outcome.DROPPED
    assert evidence.verify_chains(run.pk, "default") is None
    assert "FAILED" not in verify()


def test_the_late_end_of_a_run_taken_over_is_refused_once(sent):
    run, execution = _started()
    _pending_success(execution, external=True)
    new_generation = take_over(run)

    with pytest.raises(LeaseLost) as raised:
        execution.ending.succeed({"n": 1})
    assert str(raised.value).endswith(
        ": its result is recorded as late evidence, not as the run's end"
    )
    assert sent == ["batch"]
    after = fresh(run)
    assert (after.status, after.generation, after.end_seal) == ("running", new_generation, "")
    assert ledger_kinds(run) == ["dispatched", "late_result"]
    assert journal(run) == []


@pytest.mark.parametrize("external", [False, True], ids=["pure", "external"])
def test_the_abort_signal_refuses_the_end_of_a_canceled_run_before_anything_is_sent(external, sent):
    """The lease keeper saw the cancel while the call ran (``ctx.canceled``): the end is
    refused without a statement sent for the database to refuse."""
    run, execution = _started()
    _pending_success(execution, external=external)
    cancel_run(run.pk, "not wanted any more")
    execution.canceled.set()

    with pytest.raises(RunCanceled, match="was canceled while its step ran"):
        execution.ending.succeed({"n": 1})
    assert sent == []
    assert fresh(run).status == "canceled"
    kinds = ["dispatched", "canceled", "late_result"] if external else ["canceled"]
    assert ledger_kinds(run) == kinds
    assert evidence.verify_chains(run.pk, "default") is None


def test_the_abort_signal_of_a_run_still_ours_ends_it():
    """The signal is also the step's timeout passing: a run still ours ends as usual."""
    run, execution = _started()
    _pending_success(execution, external=False)
    execution.canceled.set()

    execution.ending.succeed({"n": 1})
    after = fresh(run)
    assert (after.status, after.output) == ("succeeded", {"n": 1})
    assert [(e.seq, e.state) for e in journal(run)] == [(0, "succeeded")]
    assert execution.outcome == Outcome.SUCCEEDED


def test_a_batched_write_of_a_canceled_run_is_refused_by_its_fence_once(sent, caplog):
    """Not only an end: the next step's first write (here the external success's flush)
    of a run canceled under its step is the fence's error, not retried one statement
    at a time."""
    caplog.set_level(logging.INFO, logger="k2b_workflows")
    run, execution = _started()
    _pending_success(execution, external=True)
    cancel_run(run.pk, "not wanted any more")

    with pytest.raises(RunCanceled):
        execution.journal.flush_pending()
    assert sent == ["batch"]
    _no_database_refusal_logged(caplog)
    assert ledger_kinds(run) == ["dispatched", "canceled", "late_result"]
    assert journal(run) == []
    assert evidence.verify_chains(run.pk, "default") is None


def test_an_end_that_reads_its_chains_first_is_refused_by_its_fence_once(sent, caplog, monkeypatch):
    """A claim that does not know every entry's row version (it read its chains again)
    ends as read: that end of a canceled run is refused once too."""
    caplog.set_level(logging.INFO, logger="k2b_workflows")
    run, execution = _started()
    _pending_success(execution, external=True)
    monkeypatch.setattr(execution.journal, "written_chains", lambda: None)
    cancel_run(run.pk, "not wanted any more")

    with pytest.raises(RunCanceled, match="recorded as late evidence, not as the run's end"):
        execution.ending.succeed({"n": 1})
    assert sent == ["as_read", "batch"]
    _no_database_refusal_logged(caplog)
    assert fresh(run).status == "canceled"
    assert ledger_kinds(run) == ["dispatched", "canceled", "late_result"]
    assert evidence.verify_chains(run.pk, "default") is None
