"""``manage.py runworkflows``: --burst, a graceful SIGTERM, --app."""

from __future__ import annotations

import re
import signal

import pytest

from k2b_workflows import start_workflow_run
from tests.models import ProviderCall
from tests.support.kernel import fresh, journal

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 90


def test_burst_exits_zero_when_nothing_is_left(start_worker):
    runs = [start_workflow_run("test.pure", {"a": i, "b": 1}) for i in range(3)]
    worker = start_worker("--burst", "--concurrency", "2")
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()
    assert [fresh(r).status for r in runs] == ["succeeded"] * 3


def test_the_stop_summary_prints_each_outcome_by_its_value(start_worker):
    """Not ``<Outcome.SUCCEEDED: 'succeeded'>``, as it printed before (#38)."""
    start_workflow_run("test.pure", {"a": 1, "b": 1})
    worker = start_worker("--burst")
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()
    out = worker.output()
    assert re.search(r"stopped: \{.*'succeeded': 1", out), out
    assert "Outcome." not in out, out


def test_run_until_idle_counts_outcomes_by_their_values():
    from k2b_workflows.testing import run_until_idle

    start_workflow_run("test.pure", {"a": 1, "b": 1})
    counts = run_until_idle()
    assert "'succeeded': 1" in repr(counts) and "Outcome." not in repr(counts), repr(counts)
    assert {type(key) for key in counts} == {str}


def test_burst_with_nothing_to_do_exits_zero(start_worker):
    worker = start_worker("--burst")
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()


def test_sigterm_lets_the_current_step_finish_and_releases_the_run(start_worker, wait):
    run = start_workflow_run("kernel.slow", {"seconds": 2})
    worker = start_worker("--concurrency", "1")
    wait(
        lambda: ProviderCall.objects.filter(action="kernel.slow").exists(),
        timeout=TIMEOUT,
        message=lambda: f"the slow step to start:\n{worker.report()}",
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()

    stopped = fresh(run)
    assert stopped.status == "queued", "released, not left running with a lease"
    assert stopped.consecutive_failures == 0
    assert [e.action_name for e in journal(run)] == ["kernel.slow"]

    later = start_worker("--burst", "--concurrency", "1")
    assert later.wait(timeout=TIMEOUT) == 0, later.output()
    assert fresh(run).status == "succeeded"
    assert ProviderCall.objects.filter(action="kernel.slow").count() == 1


def test_app_runs_only_that_apps_workflows(start_worker):
    ours = start_workflow_run("kernel.other_app", {})
    theirs = start_workflow_run("test.pure", {"a": 1, "b": 1})
    worker = start_worker("--app", "kernel_other", "--burst")
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()
    assert fresh(ours).status == "succeeded"
    assert fresh(theirs).status == "queued"


def test_an_app_id_no_registered_workflow_has_is_named_at_start_with_the_known_ones(
    start_worker,
):
    """``--app shpo`` (a typo for ``shop``) idled for ever without a word (#38)."""
    worker = start_worker("--app", "shpo", "--app", "kernel_other", "--burst")
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()
    out = worker.output()
    line = next((x for x in out.splitlines() if "no registered workflow has app id" in x), "")
    assert "WARNING" in line and "no registered workflow has app id 'shpo'" in line, out
    assert "known: " in line and "kernel_other" in line and "tests" in line, line
    assert out.count("no registered workflow has app id") == 1, out  # kernel_other is known


def test_known_app_ids_start_without_a_warning(start_worker):
    worker = start_worker("--app", "kernel_other", "--burst")
    assert worker.wait(timeout=TIMEOUT) == 0, worker.output()
    assert "no registered workflow has app id" not in worker.output()


def test_on_a_terminal_the_worker_keeps_one_live_status_line(transactional_db):
    """Run under a real pseudo-terminal: the status is rewritten in place, not scrolled."""
    import os
    import pty
    import subprocess
    import sys

    from django.db import connection

    from tests.support.processes import ROOT

    for i in range(3):
        start_workflow_run("test.pure", {"a": i, "b": 1})
    main, secondary = pty.openpty()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "K2B_TEST_DB_NAME": connection.settings_dict["NAME"],
    }
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "runworkflows", "--burst"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=secondary,
        stderr=subprocess.DEVNULL,
    )
    os.close(secondary)
    output = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the terminal closed: the worker exited
            break
        if not chunk:
            break
        output += chunk
    assert proc.wait(timeout=TIMEOUT) == 0
    os.close(main)
    text = output.decode()
    assert "\r\x1b[2K" in text  # carriage return + erase line: one line updated in place
    final = text.rsplit("\r\x1b[2K", 1)[-1]
    assert "runs 3" in final and "succeeded 3" in final, text


def test_a_worker_run_in_process_leaves_no_connection_behind():
    """``call_command("runworkflows", "--burst")`` from a test: every thread's connection closes."""
    from django.core.management import call_command
    from django.db import connection

    runs = [start_workflow_run("test.pure", {"a": i, "b": 1}) for i in range(6)]
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        (before,) = cursor.fetchone()

    call_command("runworkflows", "--burst", "--concurrency", "3")

    assert [fresh(r).status for r in runs] == ["succeeded"] * 6
    with connection.cursor() as cursor:
        # The connections the command opened: an earlier test's thread may have left
        # one of its own (a thread's Django connection outlives the thread).
        cursor.execute(
            "SELECT string_agg(query, ' | ') FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND backend_start >= %s",
            [before],
        )
        assert cursor.fetchone()[0] is None  # no listener, keeper or pool thread still connected


def test_log_format_with_logging_configured_says_it_is_ignored_and_adds_no_handler():
    """A project whose LOGGING routes k2b_workflows keeps exactly what it configured."""
    import io
    import logging

    from django.core.management import call_command

    logger = logging.getLogger("k2b_workflows")
    before = list(logger.handlers)
    err = io.StringIO()
    call_command("runworkflows", "--burst", "--log-format", "json", stderr=err)
    ignored = "--log-format json ignored: LOGGING configures the k2b_workflows logger"
    assert ignored in err.getvalue()
    assert logger.handlers == before
