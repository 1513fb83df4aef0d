"""A deploy never cuts an external call by itself (#51).

On SIGTERM a worker stops claiming and waits for every external call in flight
to return, however much longer than ``SHUTDOWN_GRACE_MS`` it takes; only a
second SIGTERM (or a SIGKILL) cuts one, and the run then takes the usual path
of an unknown outcome. Each test starts real ``runworkflows`` processes: the
call is ``test.charge``'s, which writes its provider row, then sleeps.
"""

from __future__ import annotations

import json
import signal
import time

import pytest
from django.db import connection

from k2b_workflows import start_workflow_run
from k2b_workflows.models import Incident, LedgerEntry
from tests.models import ProviderCall
from tests.support.kernel import fresh
from tests.support.processes import wait_for

pytestmark = [pytest.mark.crash, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TIMEOUT = 180  # generous: the machine is shared; nothing here is a timing assertion
#: The grace a worker gives its steps after SIGTERM: far shorter than the calls below.
GRACE_MS = 1000
#: Short: a lease the keeper stopped renewing during the wait would expire, and the
#: other worker of the deploy would take the run over.
LEASE_MS = 1500
GRACE_OVER = "grace period over; waiting for 1 external call(s) in flight"


def worker_env(**more: int) -> dict[str, str]:
    settings = {
        "SHUTDOWN_GRACE_MS": GRACE_MS,
        "RUN_LEASE_MS": LEASE_MS,
        "CLAIM_PREFETCH": 0,
        **more,
    }
    return {"K2B_TEST_SETTINGS": json.dumps(settings)}


def ledger(run) -> list[str]:
    return list(LedgerEntry.objects.filter(run=run).order_by("id").values_list("kind", flat=True))


def call_started(worker, action: str):
    """Wait until the worker's external call has written its provider row."""
    wait_for(
        lambda: ProviderCall.objects.filter(action=action, pid=worker.pid).exists(),
        timeout=TIMEOUT,
        message=lambda: f"the call to start:\n{worker.report()}",
    )


def lease_ends_after_sigterm() -> object:
    """When the run's lease would end had the keeper stopped renewing at the SIGTERM."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT k2b_now() + interval '1 millisecond' * %s", [LEASE_MS])
        return cursor.fetchone()[0]


def renewed(run, worker, since) -> str | None:
    """Whether ``worker`` holds the run with a lease ending after ``since`` ("renewed"),
    or the run ended before that could be seen ("ended"); None meanwhile."""
    row = fresh(run)
    if row.status != "running":
        return "ended"
    if f":{worker.pid}:" in row.claimed_by and row.lease_expires_at > since:
        return "renewed"
    return None


def grace_over(worker) -> None:
    """Wait until the worker says it waits for its call past the grace period; it must
    still be running then (a worker that gave the call up has exited)."""
    wait_for(
        lambda: GRACE_OVER in worker.output() or worker.proc.poll() is not None,
        timeout=TIMEOUT,
        message=lambda: f"the grace period to end:\n{worker.report()}",
    )
    assert worker.proc.poll() is None, f"the worker gave the call up:\n{worker.output()}"


def test_one_sigterm_lets_an_external_call_longer_than_the_grace_return(start_worker):
    run = start_workflow_run(
        "test.charge", {"amount": 5, "pause": "external_after_effect", "pause_s": 8}
    )
    old = start_worker("--concurrency", "2", env=worker_env())
    call_started(old, "test.charge")
    generation = fresh(run).generation

    old.signal(signal.SIGTERM)
    since = lease_ends_after_sigterm()
    grace_over(old)
    # The lease keeper goes on renewing the lease of the run whose call is waited for.
    seen = wait_for(
        lambda: renewed(run, old, since),
        timeout=TIMEOUT,
        message=lambda: f"the lease to be renewed:\n{old.report()}",
    )
    assert seen == "renewed", f"no renewal while the call ran:\n{old.output()}"
    # The deploy's new worker runs beside the old one: it takes what is queued now, and
    # would take the charge over if the old worker let its lease lapse while it waits.
    new = start_worker("--concurrency", "2", env=worker_env())
    later = start_workflow_run("kernel.slow", {"seconds": 0})

    assert old.wait(timeout=TIMEOUT) == 0, old.output()
    output = old.output()
    assert "waiting for 1 external call(s) in flight to return" in output, output
    # The call returned and its result was written by the worker that made it, under
    # the claim it made it with: nothing in doubt, no incident, charged once.
    charged = fresh(run)
    assert (charged.status, charged.generation) == ("succeeded", generation), output
    assert charged.consecutive_failures == 0
    assert ledger(run) == ["dispatched", "succeeded"], output
    assert ProviderCall.objects.filter(action="test.charge").count() == 1
    assert not Incident.objects.exists(), output

    # The stopping worker claimed nothing: the run started after its SIGTERM is the new one's.
    wait_for(
        lambda: fresh(later).status == "succeeded",
        timeout=TIMEOUT,
        message=lambda: f"the later run to end:\n{new.report()}",
    )
    pids = set(ProviderCall.objects.filter(action="kernel.slow").values_list("pid", flat=True))
    assert pids == {new.pid}, (pids, old.pid, output)
    new.signal(signal.SIGTERM)
    assert new.wait(timeout=TIMEOUT) == 0, new.output()


def test_a_second_sigterm_cuts_the_call_and_its_outcome_is_unknown(start_worker):
    run = start_workflow_run(
        "test.charge_blind", {"amount": 5, "pause": "external_after_effect", "pause_s": 600}
    )
    worker = start_worker("--concurrency", "1", env=worker_env(RUN_LEASE_MS=3000))
    call_started(worker, "test.charge_blind")
    generation = fresh(run).generation

    worker.signal(signal.SIGTERM)
    grace_over(worker)
    worker.signal(signal.SIGTERM)
    cut = time.monotonic()
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()
    # Promptly: not after the call's ten minutes.
    assert time.monotonic() - cut < 60, worker.output()

    # Handed back as after a crash: claimable one lease ahead, no failure counted.
    back = fresh(run)
    assert (back.status, back.claimed_by, back.consecutive_failures) == ("queued", "", 0), (
        worker.output()
    )
    assert back.generation == generation
    assert (back.run_after - back.updated_at).total_seconds() >= 2.9
    assert ledger(run) == ["dispatched"]

    # The next worker cannot know whether the provider charged: without a reconcile()
    # an operator decides; the call is not made again.
    second = start_worker("--concurrency", "1", env=worker_env(RUN_LEASE_MS=3000))
    wait_for(
        lambda: fresh(run).status == "needs_attention",
        timeout=TIMEOUT,
        message=lambda: f"the run to need attention:\n{second.report()}",
    )
    assert Incident.objects.filter(pk=run.pk).exists()
    assert ProviderCall.objects.filter(action="test.charge_blind").count() == 1
    assert "succeeded" not in ledger(run)
