"""Real crashes: worker processes killed with SIGKILL, or frozen with SIGSTOP past their lease.

After each: the provider saw each effect at most once (IDEMPOTENT: repeated only with
the same effect key), no run was lost, and nothing a stale worker wrote committed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from django.db import connection

from k2b_workflows import start_workflow_run
from k2b_workflows.models import BudgetCharge, LedgerEntry
from k2b_workflows.store import EFFECT_OUTCOME_UNKNOWN, lease_ms
from tests.models import DomainRow, ProviderCall
from tests.support.kernel import SETTLED, assert_invariants, describe, fresh, journal, ledger_kinds

pytestmark = [pytest.mark.crash, pytest.mark.django_db(transaction=True)]

TIMEOUT = 90  # generous: the machine is shared; nothing here is a timing assertion


def crashing_worker(start_worker, point: str):
    return start_worker("--concurrency", "1", env={"K2B_TEST_CRASH": point})


def freezing_worker(start_worker, point: str):
    return start_worker("--concurrency", "1", env={"K2B_TEST_FREEZE": point})


def healthy_worker(start_worker):
    return start_worker("--concurrency", "1")


def killed(worker) -> None:
    code = worker.wait(timeout=TIMEOUT)
    assert code == -signal.SIGKILL, f"worker exited {code}:\n{worker.output()}"


def settled(wait, run, worker) -> None:
    wait(
        lambda: fresh(run).status in SETTLED,
        timeout=TIMEOUT,
        message=lambda: f"run {run.pk} to settle:\n{worker.report()}",
    )


def is_stopped(pid: int) -> bool:
    """True once the process is in the stopped state (``T``) after its SIGSTOP."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def thaw_and_stop(worker) -> None:
    """SIGCONT, then a graceful SIGTERM: when it exits, whatever it tried has ended."""
    worker.signal(signal.SIGCONT)
    worker.signal(signal.SIGTERM)
    code = worker.wait(timeout=TIMEOUT)
    assert code == 0, f"thawed worker exited {code}:\n{worker.output()}"


# -- SIGKILL -----------------------------------------------------------------------


def test_sigkill_inside_a_transactional_step_loses_row_and_journal_and_the_step_reruns_once(
    start_worker, wait
):
    run = start_workflow_run("test.tx", {"key": "k", "crash": "tx_after_write"})
    first = crashing_worker(start_worker, "tx_after_write")
    killed(first)
    assert not DomainRow.objects.exists()
    assert journal(run) == []

    second = healthy_worker(start_worker)
    settled(wait, run, second)
    assert fresh(run).status == "succeeded", describe(run)
    (row,) = DomainRow.objects.all()
    (step0, _) = journal(run)
    assert row.pid == second.pid
    assert row.generation == step0.generation > 1
    assert_invariants()


def test_sigkill_after_a_transactional_commit_never_reruns_the_committed_step(start_worker, wait):
    run = start_workflow_run("test.tx", {"key": "k", "crash_next": True})
    first = crashing_worker(start_worker, "pure")
    killed(first)
    (row,) = DomainRow.objects.all()
    assert row.pid == first.pid
    assert [e.seq for e in journal(run)] == [0]

    second = healthy_worker(start_worker)
    settled(wait, run, second)
    assert fresh(run).status == "succeeded", describe(run)
    assert list(DomainRow.objects.values_list("pid", flat=True)) == [first.pid]
    step0, step1 = journal(run)
    assert step0.generation == 1 and step1.generation > 1
    assert_invariants()


def test_sigkill_after_an_idempotent_effect_repeats_it_only_with_the_same_effect_key(
    start_worker, wait
):
    run = start_workflow_run(
        "test.idem", {"to": "a@example.com", "crash": "idem_after_effect", "costly": True}
    )
    killed(crashing_worker(start_worker, "idem_after_effect"))
    assert ProviderCall.objects.count() == 1
    assert not DomainRow.objects.exists()

    second = healthy_worker(start_worker)
    settled(wait, run, second)
    done = fresh(run)
    assert done.status == "succeeded", describe(run)
    calls = list(ProviderCall.objects.filter(action="test.send_idempotent"))
    assert len(calls) == 2
    assert {c.effect_key for c in calls} == {f"{run.pk}:0"}
    (row,) = DomainRow.objects.all()  # the fenced write committed once, by the survivor
    assert row.key == f"idem:{run.pk}:0:{done.generation}"
    assert BudgetCharge.objects.filter(run=run).count() == 1
    assert_invariants()


@pytest.mark.parametrize("point", ["external_before_effect", "external_after_effect"])
def test_sigkill_around_an_external_effect_without_reconcile_needs_attention(
    start_worker, wait, point
):
    run = start_workflow_run("test.charge_blind", {"amount": 9, "crash": point})
    killed(crashing_worker(start_worker, point))
    assert ledger_kinds(run) == ["dispatched"]

    second = healthy_worker(start_worker)
    settled(wait, run, second)
    done = fresh(run)
    assert (done.status, done.error_code) == ("needs_attention", EFFECT_OUTCOME_UNKNOWN)
    assert done.attention_step == 0
    expected = 1 if point == "external_after_effect" else 0
    assert ProviderCall.objects.filter(action="test.charge_blind").count() == expected
    assert journal(run) == []
    assert_invariants()


def test_sigkill_after_an_external_effect_reconciles_and_succeeds(start_worker, wait):
    run = start_workflow_run("test.charge", {"amount": 9, "crash": "external_after_effect"})
    killed(crashing_worker(start_worker, "external_after_effect"))

    second = healthy_worker(start_worker)
    settled(wait, run, second)
    done = fresh(run)
    assert done.status == "succeeded", describe(run)
    (call,) = ProviderCall.objects.filter(action="test.charge")
    assert done.output == {"charge_id": f"ch_{call.pk}", "reconciled": True}
    assert ledger_kinds(run).count("dispatched") == 1
    assert "reconciled" in ledger_kinds(run)
    assert_invariants()


def test_sigkill_before_an_external_effect_is_reconciled_absent_and_never_dispatched_again(
    start_worker, wait
):
    run = start_workflow_run("test.charge", {"amount": 9, "crash": "external_before_effect"})
    killed(crashing_worker(start_worker, "external_before_effect"))

    second = healthy_worker(start_worker)
    settled(wait, run, second)
    done = fresh(run)
    # The provider has no such charge; after doubt that fails the step, it is not re-sent.
    assert done.status == "failed", describe(run)
    assert not ProviderCall.objects.filter(action="test.charge").exists()
    assert ledger_kinds(run).count("dispatched") == 1
    assert "reconciled" in ledger_kinds(run)
    assert_invariants()


def test_sigkill_before_an_effect_reconciled_absent_dispatches_again_under_the_same_key(
    start_worker, wait
):
    """The payments recipe (docs/effects.md): killed between the ledger's "dispatched"
    and the provider's call, the charge is absent; its provider deduplicates by the
    effect key, so the step runs again under that key and the card is charged once."""
    run = start_workflow_run("test.charge_by_key", {"amount": 9, "crash": "external_before_effect"})
    killed(crashing_worker(start_worker, "external_before_effect"))
    assert not ProviderCall.objects.filter(action="test.charge_by_key").exists()

    second = healthy_worker(start_worker)
    settled(wait, run, second)
    done = fresh(run)
    assert done.status == "succeeded", describe(run)
    (call,) = ProviderCall.objects.filter(action="test.charge_by_key")
    assert done.output == {"charge_id": f"ch_{call.pk}"}
    dispatched = LedgerEntry.objects.filter(run=run, kind="dispatched").order_by("id")
    assert [d.invocation_key for d in dispatched] == [
        f"{call.effect_key}:1",
        f"{call.effect_key}:2",
    ]
    assert call.invocation_key == f"{call.effect_key}:2"
    assert "reconciled" in ledger_kinds(run)
    assert_invariants()


# -- SIGSTOP past the lease ----------------------------------------------------------


def frozen(wait, worker) -> None:
    wait(
        lambda: worker.proc.poll() is None and is_stopped(worker.pid),
        timeout=TIMEOUT,
        message=lambda: f"worker {worker.pid} to freeze:\n{worker.report()}",
    )


def test_a_worker_frozen_inside_a_transactional_step_is_taken_over_and_commits_nothing(
    start_worker, wait
):
    run = start_workflow_run("kernel.tx_freeze", {"key": "f", "freeze": "tx_after_write"})
    first = freezing_worker(start_worker, "tx_after_write")
    frozen(wait, first)

    # The frozen transaction holds the run row lock; the server ends it after a lease
    # of idleness, and only then can the lease expire into another worker's claim.
    second = healthy_worker(start_worker)
    settled(wait, run, second)
    done = fresh(run)
    assert done.status == "succeeded", describe(run)

    thaw_and_stop(first)
    (row,) = DomainRow.objects.all()
    assert (row.key, row.pid) == (f"f:{done.generation}", second.pid)
    (entry,) = journal(run)
    assert entry.generation == done.generation
    assert not DomainRow.objects.filter(pid=first.pid).exists()
    assert_invariants()


def test_a_worker_frozen_inside_a_fenced_idempotent_write_is_taken_over_and_commits_nothing(
    start_worker, wait
):
    run = start_workflow_run("kernel.idem_freeze", {"freeze": "idem_in_fence"})
    first = freezing_worker(start_worker, "idem_in_fence")
    frozen(wait, first)

    second = healthy_worker(start_worker)
    settled(wait, run, second)
    done = fresh(run)
    assert done.status == "succeeded", describe(run)

    thaw_and_stop(first)
    calls = list(ProviderCall.objects.filter(action="kernel.idem_freeze"))
    assert [c.pid for c in calls] == [first.pid, second.pid]
    assert {c.effect_key for c in calls} == {f"{run.pk}:0"}
    rows = list(DomainRow.objects.values("key", "generation", "pid"))
    assert len(rows) == 1, (rows, first.pid, second.pid, first.output())
    assert (rows[0]["generation"], rows[0]["pid"]) == (done.generation, second.pid)
    assert_invariants()


def _lease_extended_since(run, since) -> bool:
    """The run is still its first holder's, and someone extended its lease after ``since``."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT lease_expires_at > %s FROM k2b_run"
            " WHERE id = %s AND status = 'running' AND generation = 1",
            [since, run.pk],
        )
        row = cursor.fetchone()
    return bool(row and row[0])


@pytest.mark.skipif(
    bool(os.environ.get("K2B_TEST_BOUNCER_PORT")) and not os.environ.get("K2B_TEST_DIRECT_URL"),
    reason="the keeper reaches PostgreSQL through the pooler: no presence lock, the heartbeat"
    " alone tells, and a holder frozen past a lease is taken for gone",
)
def test_a_worker_frozen_after_an_external_effect_keeps_the_run_until_it_is_killed(
    start_worker, wait
):
    """Frozen, the holder is still there (its presence lock, #47): its call may still
    return, so nobody asks the provider meanwhile. Killed, it is gone at once, and
    the run is reconciled from what the provider saw."""
    run = start_workflow_run("kernel.charge_freeze", {"freeze": "external_after_effect"})
    first = freezing_worker(start_worker, "external_after_effect")
    frozen(wait, first)
    with connection.cursor() as cursor:
        cursor.execute("SELECT k2b_now() + interval '1 millisecond' * %s", [lease_ms()])
        (since,) = cursor.fetchone()

    second = healthy_worker(start_worker)
    # Past the frozen holder's lease and heartbeat, the other worker extends the lease.
    wait(
        lambda: _lease_extended_since(run, since),
        timeout=TIMEOUT,
        message=lambda: f"the lease to be extended:\n{second.report()}",
    )
    assert not LedgerEntry.objects.filter(run=run).exclude(kind="dispatched").exists()

    first.signal(signal.SIGKILL)
    killed(first)
    settled(wait, run, second)
    done = fresh(run)
    assert done.status == "succeeded", describe(run)
    (call,) = ProviderCall.objects.filter(action="kernel.charge_freeze")
    assert done.output == {"charge_id": f"ch_{call.pk}", "reconciled": True}
    assert call.generation < done.generation
    assert not LedgerEntry.objects.filter(run=run, kind="late_result").exists()
    (entry,) = journal(run)
    assert entry.generation == done.generation
    assert_invariants()


# -- PURE successes riding on the next write --------------------------------------------


def _pure_calls(run) -> dict[int, list[int]]:
    """Each PURE step of ``kernel.pure_riding``: the pids of the processes that ran it."""
    calls: dict[int, list[int]] = {}
    for call in ProviderCall.objects.filter(action="kernel.counted_pure").order_by("id"):
        run_id, seq = call.effect_key.rsplit(":", 1)
        if run_id == str(run.pk):
            calls.setdefault(int(seq), []).append(call.pid)
    return calls


def test_sigkill_after_a_pure_steps_run_before_the_next_write_runs_it_again(start_worker, wait):
    """Step 0's ``run()`` returned; its success waits for the run's next write. A
    SIGKILL in step 1 loses it, and the takeover runs step 0 again, as DESIGN.md
    promises for PURE. The three successes then commit with the run's end."""
    run = start_workflow_run("kernel.pure_riding", {"at": 1})
    first = crashing_worker(start_worker, "pure_riding")
    killed(first)
    assert journal(run) == []  # nothing was written before the kill
    assert _pure_calls(run) == {0: [first.pid], 1: [first.pid]}

    second = healthy_worker(start_worker)
    settled(wait, run, second)
    done = fresh(run)
    assert done.status == "succeeded", describe(run)
    assert _pure_calls(run) == {0: [first.pid, second.pid], 1: [first.pid, second.pid]} | {
        2: [second.pid]
    }
    entries = journal(run)
    assert [e.seq for e in entries] == [0, 1, 2]
    assert {e.generation for e in entries} == {done.generation}
    assert_invariants()


def test_a_pure_step_whose_success_rode_on_a_committed_write_never_runs_again(start_worker, wait):
    """Steps 0 and 1 (PURE) rode on step 2's transactional commit; a SIGKILL in step 3
    loses only step 3: after the takeover, none of the committed steps runs again."""
    run = start_workflow_run("kernel.pure_riding", {"at": 2, "write": True})
    first = crashing_worker(start_worker, "pure_riding")
    killed(first)
    (row,) = DomainRow.objects.all()
    assert row.pid == first.pid
    committed = journal(run)
    assert [e.seq for e in committed] == [0, 1, 2]
    assert {e.generation for e in committed} == {row.generation}

    second = healthy_worker(start_worker)
    settled(wait, run, second)
    assert fresh(run).status == "succeeded", describe(run)
    assert _pure_calls(run) == {0: [first.pid], 1: [first.pid], 3: [first.pid, second.pid]}
    assert list(DomainRow.objects.values_list("pid", flat=True)) == [first.pid]
    assert [e.seq for e in journal(run)] == [0, 1, 2, 3]
    assert_invariants()


def test_a_fenced_out_workers_buffered_pure_successes_never_commit(start_worker, wait):
    """Frozen in step 1 with step 0's success buffered, the first worker loses the run to
    a takeover; thawed, its end is refused by the fence: every entry is the survivor's."""
    run = start_workflow_run("kernel.pure_riding", {"at": 1})
    first = freezing_worker(start_worker, "pure_riding")
    frozen(wait, first)

    second = healthy_worker(start_worker)
    settled(wait, run, second)
    done = fresh(run)
    assert done.status == "succeeded", describe(run)

    thaw_and_stop(first)
    assert fresh(run).generation == done.generation
    entries = journal(run)
    assert [e.seq for e in entries] == [0, 1, 2]
    assert {e.generation for e in entries} == {done.generation} != {1}
    assert first.pid in _pure_calls(run)[0]  # it had run step 0: its success was buffered
    assert_invariants()
