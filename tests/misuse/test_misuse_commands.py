"""Commands answer every bad argument with one line, and never print control characters raw.

Dry runs are bounded like real runs and report workflow exceptions as errors.
"""

from __future__ import annotations

import os
import subprocess
import sys
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import override_settings

from k2b_workflows import dry_run, start_workflow_run
from k2b_workflows.testing import run_until_idle
from tests.support.misuse import Unchanged
from tests.support.processes import ROOT

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["purgeworkflows", "--older-than-days", "nan"], "--older-than-days: must be a number"),
        (["purgeworkflows", "--older-than-days", "inf"], "--older-than-days: must be a number"),
        (["purgeworkflows", "--older-than-days", "1e12"], "at most 36500, not 1e12"),
        (["purgeworkflows", "--older-than-days", "0"], "above 0"),
        (
            ["purgeworkflows", "--older-than-days", "1", "--batch", "9223372036854775808"],
            "--batch: must be between 1 and 100000",
        ),
        (["workflowruns", "--limit", "1e20"], "--limit: must be a whole number, not '1e20'"),
        (["workflowruns", "--limit", str(10**20)], "--limit: must be between 0 and 1000000"),
        (["workflowruns", "--app", "a\x00"], "--app: must be 1 to 100 characters without NUL"),
        (["runworkflows", "--concurrency", "0"], "--concurrency: must be between 1 and 256"),
        (["runworkflows", "--concurrency", "2000"], "--concurrency: must be between 1 and 256"),
        (
            ["dryrun", "test.pure", "--input", "[" * 100_000 + "]" * 100_000],
            "--input is nested too deeply",
        ),
        (["dryrun", "test.pure", "--input", '{"a": "\\u0000"}'], "contains a NUL"),
    ],
)
def test_bad_arguments_are_one_line_command_errors_and_write_nothing(args, match):
    with Unchanged(), pytest.raises(CommandError, match=match) as info:
        call_command(*args, stdout=StringIO(), stderr=StringIO())
    assert "\n" not in str(info.value)


def test_a_concurrency_beyond_max_connections_is_refused_naming_the_setting():
    with connection.cursor() as cursor:
        cursor.execute("SHOW max_connections")
        max_connections = int(cursor.fetchone()[0])
    if max_connections > 250:
        pytest.skip("the server allows more connections than the concurrency cap")
    with pytest.raises(CommandError, match=r"needs \d+ connections; the server allows"):
        call_command("runworkflows", "--concurrency", "253", "--burst", stdout=StringIO())


def test_bad_arguments_from_the_command_line_print_one_line_without_traceback():
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    result = subprocess.run(
        [sys.executable, "manage.py", "purgeworkflows", "--older-than-days", "nan"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "error: argument --older-than-days: must be a number above 0 and at most 36500, not nan"
        )
    )


def test_dryrun_of_an_input_the_workflow_cannot_read_reports_the_error():
    out = StringIO()
    with pytest.raises(CommandError, match="1 error"):
        call_command("dryrun", "misuse.crashy", "--input", "[1,2]", stdout=out)
    assert "root: workflow code raised TypeError" in out.getvalue()
    assert "NOT OK" in out.getvalue()


def test_workflowruns_waiting_escapes_control_characters_in_wait_keys():
    run = start_workflow_run("test.wait", {"key": "\x1b[2J\x1b]0;pwned\x07"})
    run_until_idle(timeout=60)
    out = StringIO()
    call_command("workflowruns", "--waiting", stdout=out)
    text = out.getvalue()
    assert str(run.pk) in text
    assert "\x1b" not in text and "\x07" not in text
    assert "\\x1b[2J\\x1b]0;pwned\\x07" in text


def test_dryrun_output_escapes_control_characters():
    out = StringIO()
    with pytest.raises(CommandError):
        call_command("dryrun", "misuse.crashy", "--input", '{"x": "\\u001b[31m"}', stdout=out)
    assert "\x1b" not in out.getvalue()


# -- dry runs are bounded ------------------------------------------------------------


def test_a_dry_run_stops_at_max_steps():
    report = dry_run("misuse.poll_forever", {})
    assert report.failed == "MAX_STEPS_EXCEEDED"
    assert len(report.steps) == 21  # steps 0..19, then step 20 refused
    assert report.steps[-1].error == "MAX_STEPS_EXCEEDED"


def test_a_dry_run_of_a_loop_that_swallows_the_failure_still_ends():
    report = dry_run("misuse.poll_forever_catching", {})
    assert not report.ok
    assert any("stopped after 10000 steps" in e for e in report.errors)


def test_a_workflow_exception_is_an_error_of_the_report():
    report = dry_run("misuse.crashy", {"no_sku": True})
    assert report.errors == ["root: workflow code raised KeyError: 'sku'"]
    assert not report.ok


def test_a_dry_run_refuses_more_children_than_max_steps_allows():
    report = dry_run("misuse.fan_out", {"n": 6})
    assert report.failed == "MAX_STEPS_EXCEEDED"
    assert dry_run("misuse.fan_out", {"n": 3}).ok


@override_settings(K2B_WORKFLOWS={"MAX_CHILDREN_PER_STEP": 2})
def test_a_dry_run_enforces_the_fan_out_bound():
    assert dry_run("misuse.fan_out", {"n": 3}).failed == "FAN_OUT_EXCEEDED"


# -- configuration mistakes ------------------------------------------------------------


def test_without_pgtrigger_the_system_check_says_so_instead_of_a_type_error(tmp_path):
    (tmp_path / "settings_without_pgtrigger.py").write_text(
        "from tests.settings import *\n"
        "INSTALLED_APPS = [a for a in INSTALLED_APPS if a != 'pgtrigger']\n"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "settings_without_pgtrigger",
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
    }
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "(k2b_workflows.E003) k2b_workflows needs 'pgtrigger' in INSTALLED_APPS" in (
        result.stderr
    )
    assert "TypeError" not in result.stderr
    assert "Traceback" not in result.stderr


def test_the_admin_dry_run_page_reports_a_workflow_exception_instead_of_a_500():
    from django.contrib.auth.models import User
    from django.test import Client
    from django.urls import reverse

    client = Client()
    client.force_login(User.objects.create_superuser("paula", "p@example.com", "pw"))
    url = reverse("admin:k2b_workflows_workflowrun_dry_run")
    for name in ("misuse.crashy", "misuse.poll_forever"):
        response = client.post(url, {"workflow": name, "input": "[1, 2]"})
        assert response.status_code == 200
        assert not response.context["report"].ok
    crashy = client.post(url, {"workflow": "misuse.crashy", "input": "[1, 2]"})
    assert "root: workflow code raised TypeError" in crashy.content.decode()
