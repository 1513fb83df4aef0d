"""A fork's IDEMPOTENT step killed after its effect: the worker that takes it over calls the
provider again under the original's effect key, read from the fork's sealed ledger at each
claim, never under a key of the fork's own."""

from __future__ import annotations

import signal

import pytest

from k2b_workflows import fork_workflow_run, start_workflow_run
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall
from tests.support.kernel import SETTLED, assert_invariants, describe, fresh

pytestmark = [pytest.mark.crash, pytest.mark.django_db(transaction=True)]

TIMEOUT = 90  # generous: the machine is shared; nothing here is a timing assertion


def test_sigkill_in_a_forks_idempotent_step_repeats_it_under_the_originals_key(start_worker, wait):
    original = start_workflow_run(
        "test.idem", {"to": "a@example.com", "crash": "idem_after_effect"}
    )
    run_until_idle()  # no crash asked of this process: the original succeeds
    assert fresh(original).status == "succeeded"

    fork = fork_workflow_run(original.pk, from_step=0, actor="ops", reason="resend")
    crashing = start_worker("--concurrency", "1", env={"K2B_TEST_CRASH": "idem_after_effect"})
    code = crashing.wait(timeout=TIMEOUT)
    assert code == -signal.SIGKILL, f"worker exited {code}:\n{crashing.output()}"

    healthy = start_worker("--concurrency", "1")
    wait(
        lambda: fresh(fork).status in SETTLED,
        timeout=TIMEOUT,
        message=lambda: f"run {fork.pk} to settle:\n{healthy.report()}",
    )
    assert fresh(fork).status == "succeeded", describe(fork)
    keys = list(
        ProviderCall.objects.filter(action="test.send_idempotent").values_list(
            "effect_key", flat=True
        )
    )
    assert keys == [f"{original.pk}:0"] * 3  # the original's call, the killed one, the retry
    assert_invariants()
