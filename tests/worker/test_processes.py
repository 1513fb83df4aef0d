"""``runworkflows --processes N``: a supervisor of N worker processes, killed in every way.

Each test starts the real command as a subprocess on the test database and
kills real processes: a child (restarted, nothing lost, no effect twice), the
supervisor with SIGKILL (its children go too, handing their runs back), the
supervisor with SIGTERM (every child hands its runs back, exit 0), and a
group whose children cannot start (it stops, no restart loop).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import tempfile
import urllib.request
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from k2b_workflows import fleet, start_workflow_run
from k2b_workflows.models import Incident, LedgerEntry, WorkflowRun
from tests.models import DomainRow, ProviderCall
from tests.support.kernel import SETTLED, assert_invariants, fresh
from tests.support.processes import wait_for

pytestmark = [pytest.mark.crash, pytest.mark.django_db(transaction=True)]

#: Generous: the machine is shared; nothing here is a timing assertion. ``make mutants``
#: lowers it, where each of these tests is expected to fail by waiting it out.
TIMEOUT = float(os.environ.get("K2B_PROCESS_TEST_TIMEOUT", "90"))
#: A short grace, so that a step sleeping for a minute is handed back, not waited for;
#: no prefetch, so that one worker process does not claim the other's share.
SHORT_GRACE = {"K2B_TEST_SETTINGS": json.dumps({"SHUTDOWN_GRACE_MS": 1000, "CLAIM_PREFETCH": 0})}


@pytest.fixture
def start_group(start_worker):
    """``start_worker`` for supervisors: at teardown no child of theirs is left running.

    The suite's teardown SIGKILLs each supervisor; its children then stop by
    themselves, but the test database may be dropped before they have.
    """
    started = []

    def start(*args: str, env: dict[str, str] | None = None):
        supervisor = start_worker(*args, env=env)
        started.append(supervisor)
        return supervisor

    yield start
    for supervisor in started:
        if supervisor.proc.poll() is None:
            pids = children_of(supervisor.pid)
            supervisor.kill()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            wait_for(lambda pids=pids: not any(running(p) for p in pids), timeout=30)


def children_of(pid: int) -> set[int]:
    """Live (not zombie) processes whose parent is ``pid``, read from /proc."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an orphan's reaper may be slow)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def group(wait, supervisor, count: int = 2) -> set[int]:
    """Wait until the supervisor has ``count`` children; their pids."""
    return wait(
        lambda: (pids := children_of(supervisor.pid)) and len(pids) == count and pids,
        timeout=TIMEOUT,
        message=lambda: f"{count} worker processes:\n{supervisor.report()}",
    )


def registered(wait, pids: set[int], supervisor) -> None:
    """Wait until every pid has a live row of its own on the Workers page."""
    wait(
        lambda: {w["pid"] for w in fleet.live_workers()} >= pids,
        timeout=TIMEOUT,
        message=lambda: f"rows of {pids}: {fleet.live_workers()}\n{supervisor.report()}",
    )


def settle(wait, supervisor) -> None:
    wait(
        lambda: not WorkflowRun.objects.exclude(status__in=SETTLED).exists(),
        timeout=TIMEOUT,
        message=lambda: f"every run to settle:\n{supervisor.report()}",
    )


@pytest.mark.django_db
@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan", "1.5", ""])
def test_a_process_count_that_is_not_auto_or_at_least_one_is_an_argument_error(value):
    with pytest.raises(CommandError, match="--processes: must be auto or a whole number"):
        call_command("runworkflows", "--processes", value, "--burst")


def test_a_burst_group_drains_the_queue_in_separate_worker_rows_and_exits_zero(start_group, wait):
    runs = [start_workflow_run("test.pure", {"a": i, "b": 1}) for i in range(40)]
    supervisor = start_group("--processes", "2", "--concurrency", "2", "--burst")
    assert supervisor.wait(timeout=TIMEOUT) == 0, supervisor.output()
    assert {fresh(r).status for r in runs} == {"succeeded"}
    rows = list(fleet_rows())
    assert len(rows) == 2, rows
    assert {state for _, state in rows} == {"stopped"}
    assert supervisor.pid not in {pid for pid, _ in rows}, "the supervisor is no worker"
    assert supervisor.output().count("drained the queue") == 2


def fleet_rows() -> list[tuple[int, str]]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pid, state FROM k2b_worker ORDER BY pid")
        return list(cursor.fetchall())


def test_a_sigkilled_worker_process_is_restarted_and_no_run_is_lost_or_its_effect_repeated(
    start_group, wait
):
    slow = start_workflow_run("kernel.slow", {"seconds": 2})
    tx = [start_workflow_run("test.tx", {"key": f"k{i}"}) for i in range(20)]
    idem = [start_workflow_run("test.idem", {"to": f"u{i}"}) for i in range(10)]
    supervisor = start_group("--processes", "2", "--concurrency", "2")
    first = group(wait, supervisor)

    call = wait(
        lambda: ProviderCall.objects.filter(action="kernel.slow").first(),
        timeout=TIMEOUT,
        message=lambda: f"the slow step to start:\n{supervisor.report()}",
    )
    victim = call.pid
    assert victim in first, f"the step ran in {victim}, not in a child of the supervisor"
    os.kill(victim, signal.SIGKILL)

    wait(
        lambda: (now := children_of(supervisor.pid)) and len(now) == 2 and victim not in now,
        timeout=TIMEOUT,
        message=lambda: f"a new worker process beside {first - {victim}}:\n{supervisor.report()}",
    )
    assert re.search(
        rf"\(pid {victim}\) was killed by SIGKILL .*; restarting it", supervisor.output()
    )
    settle(wait, supervisor)

    assert {fresh(r).status for r in [slow, *tx, *idem]} == {"succeeded"}, supervisor.report()
    # TRANSACTIONAL: one row per run (a second would have failed the run on the unique key).
    assert sorted(DomainRow.objects.filter(key__startswith="k").values_list("key", flat=True)) == (
        sorted(f"k{i}" for i in range(20))
    )
    # IDEMPOTENT: the provider saw each run's effect under one key only.
    keys = ProviderCall.objects.filter(action="test.send_idempotent").values_list(
        "effect_key", flat=True
    )
    assert len(set(keys)) == len(idem)
    # The killed step ran again elsewhere (PURE: run again), after its lease expired.
    again = ProviderCall.objects.filter(action="kernel.slow").exclude(pid=victim)
    assert again.exists()
    assert_invariants()

    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(timeout=TIMEOUT) == 0, supervisor.output()


def test_sigkill_of_the_supervisor_takes_every_worker_process_with_it(start_group, wait):
    runs = [start_workflow_run("kernel.slow", {"seconds": 60}) for _ in range(2)]
    supervisor = start_group("--processes", "2", "--concurrency", "1", env=SHORT_GRACE)
    pids = group(wait, supervisor)
    registered(wait, pids, supervisor)
    wait(
        lambda: ProviderCall.objects.filter(action="kernel.slow").exists(),
        timeout=TIMEOUT,
        message=lambda: f"a slow step to start:\n{supervisor.report()}",
    )

    supervisor.kill()
    try:
        wait(
            lambda: not any(running(pid) for pid in pids),
            timeout=30,
            message=lambda: f"the orphans {[p for p in pids if running(p)]} to exit",
        )
    except BaseException:
        for pid in pids:  # the failed wait would leave them running past this test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise
    # They stopped as after a SIGTERM: their runs handed back, no failure counted.
    for run in runs:
        run = fresh(run)
        assert run.status == "queued", (run.status, supervisor.output())
        assert run.consecutive_failures == 0


def test_sigkill_of_the_supervisor_lets_each_child_finish_its_external_step_as_after_one_sigterm(
    start_group, wait
):
    """Each child heard of its parent's death once: the kernel's parent-death signal
    and the child's own watcher both sent SIGTERM, and the second forced an exit
    mid-step, leaving each EXTERNAL charge in doubt (#38). One SIGTERM waits
    for an external call in flight until it returns, past the grace period (#51)."""
    runs = [
        start_workflow_run(
            "test.charge_blind", {"amount": i, "pause": "external_after_effect", "pause_s": 5}
        )
        for i in range(2)
    ]
    supervisor = start_group("--processes", "2", "--concurrency", "1", env=SHORT_GRACE)
    pids = group(wait, supervisor)
    registered(wait, pids, supervisor)
    wait(
        lambda: set(ProviderCall.objects.values_list("pid", flat=True)) == pids,
        timeout=TIMEOUT,
        message=lambda: f"a charge in flight in each of {pids}:\n{supervisor.report()}",
    )

    supervisor.kill()
    in_flight = not LedgerEntry.objects.filter(kind="succeeded").exists()
    try:
        wait(
            lambda: not any(running(pid) for pid in pids),
            timeout=TIMEOUT,
            message=lambda: f"the orphans {[p for p in pids if running(p)]} to exit",
        )
    except BaseException:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise
    output = supervisor.output()
    for run in runs:
        kinds = list(
            LedgerEntry.objects.filter(run=run).order_by("id").values_list("kind", flat=True)
        )
        # The charge in flight completed and its result was recorded: nothing in doubt.
        assert kinds == ["dispatched", "succeeded"], (kinds, output)
        run = fresh(run)
        assert run.status in ("queued", "succeeded"), (run.status, output)
        assert run.consecutive_failures == 0
    assert not Incident.objects.exists(), output
    assert ProviderCall.objects.count() == 2
    assert in_flight, "a charge ended before the supervisor was killed: nothing was tested"


def test_a_second_sigterm_of_the_supervisor_reaches_each_child_and_cuts_its_call(start_group, wait):
    """The first signal is forwarded once: each child waits for its external call past
    the grace period. The second is forwarded as a second SIGTERM: each child hands its
    run back at once, one lease ahead, its call's outcome unknown (#51)."""
    runs = [
        start_workflow_run(
            "test.charge_blind", {"amount": i, "pause": "external_after_effect", "pause_s": 600}
        )
        for i in range(2)
    ]
    supervisor = start_group("--processes", "2", "--concurrency", "1", env=SHORT_GRACE)
    pids = group(wait, supervisor)
    registered(wait, pids, supervisor)
    wait(
        lambda: set(ProviderCall.objects.values_list("pid", flat=True)) == pids,
        timeout=TIMEOUT,
        message=lambda: f"a charge in flight in each of {pids}:\n{supervisor.report()}",
    )

    supervisor.signal(signal.SIGTERM)
    wait(
        lambda: (
            supervisor.output().count("grace period over; waiting for 1 external call") == 2
            or supervisor.proc.poll() is not None
        ),
        timeout=TIMEOUT,
        message=lambda: f"both children to wait for their calls:\n{supervisor.report()}",
    )
    assert supervisor.proc.poll() is None, supervisor.output()
    assert all(running(pid) for pid in pids), supervisor.output()

    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(timeout=TIMEOUT) == 0, supervisor.output()
    assert not [pid for pid in pids if running(pid)], "the supervisor exited before a child"
    for run in runs:
        run = fresh(run)
        assert (run.status, run.consecutive_failures) == ("queued", 0), supervisor.output()
        # Claimable one lease ahead, as after a crash: the call may still land.
        assert (run.run_after - run.updated_at).total_seconds() >= 1.9
        kinds = LedgerEntry.objects.filter(run=run).values_list("kind", flat=True)
        assert list(kinds) == ["dispatched"]


def test_sigterm_of_the_supervisor_hands_every_run_back_and_exits_zero_after_its_children(
    start_group, wait
):
    runs = [start_workflow_run("kernel.slow", {"seconds": 60}) for _ in range(4)]
    supervisor = start_group("--processes", "2", "--concurrency", "1", env=SHORT_GRACE)
    pids = group(wait, supervisor)
    registered(wait, pids, supervisor)
    wait(
        lambda: set(ProviderCall.objects.values_list("pid", flat=True)) == pids,
        timeout=TIMEOUT,
        message=lambda: f"a slow step in each of {pids}:\n{supervisor.report()}",
    )

    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(timeout=TIMEOUT) == 0, supervisor.output()
    assert not [pid for pid in pids if running(pid)], "the supervisor exited before a child"
    for run in runs:
        run = fresh(run)
        assert run.status == "queued", (run.status, supervisor.output())
        assert run.consecutive_failures == 0
    assert {state for _, state in fleet_rows()} == {"stopped"}
    assert "restarting" not in supervisor.output()


def test_a_configuration_error_in_the_workers_stops_the_group_without_restarting_them(
    start_group,
):
    from django.db import connection

    missing = connection.settings_dict["NAME"] + "_missing"
    supervisor = start_group(
        "--processes", "2", "--concurrency", "1", env={"K2B_TEST_DB_NAME": missing}
    )
    assert supervisor.wait(timeout=TIMEOUT) == 2, supervisor.output()
    out = supervisor.output()
    assert "a configuration error; stopping the group" in out
    assert out.count("started (pid") == 2, out
    assert "restarting" not in out


def test_the_health_file_and_the_metrics_port_cover_the_whole_group(start_group, wait):
    health = Path(tempfile.mkdtemp(prefix="k2b-health-test-")) / "alive"
    supervisor = start_group(
        "--processes",
        "2",
        "--concurrency",
        "2",
        "--health-file",
        str(health),
        "--metrics-port",
        "0",
    )
    try:
        port = int(
            wait(
                lambda: re.search(r"metrics of the group on port (\d+)", supervisor.output()),
                timeout=TIMEOUT,
                message=lambda: f"the metrics port:\n{supervisor.report()}",
            ).group(1)
        )
        pids = group(wait, supervisor)
        registered(wait, pids, supervisor)
        wait(health.exists, timeout=TIMEOUT, message=lambda: f"{health}:\n{supervisor.report()}")

        runs = [start_workflow_run("test.pure", {"a": i, "b": 1}) for i in range(20)]
        settle(wait, supervisor)
        assert {fresh(r).status for r in runs} == {"succeeded"}

        def pure_steps() -> float:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
                text = page.read().decode()
            return sum(
                float(m.group(1))
                for m in re.finditer(
                    r'^k2b_steps_total\{effect="pure",outcome="succeeded"\} (\S+)$', text, re.M
                )
            )

        # 2 steps per run, counted in whichever child ran them, served as one sum.
        wait(lambda: pure_steps() == 40, timeout=TIMEOUT, message=lambda: f"{pure_steps()}")
        # The group's file is as fresh as its least fresh child: both loop, so it is fresh.
        wait(
            lambda: time_since(health) < 5,
            timeout=TIMEOUT,
            message=lambda: f"{health} fresh: {time_since(health)}",
        )
        supervisor.signal(signal.SIGTERM)
        assert supervisor.wait(timeout=TIMEOUT) == 0, supervisor.output()
        assert not health.exists(), "a stopped group must not look healthy"
    finally:
        health.unlink(missing_ok=True)
        os.rmdir(health.parent)


def time_since(path: Path) -> float:
    from k2b_workflows.worker.health import age_s

    age = age_s(path)
    return float("inf") if age is None else age
