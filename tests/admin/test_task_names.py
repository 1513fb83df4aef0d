"""Task calls are named by their task's path (#51): the runs list's filters by task and
by queue and its search, the run page, the incident queue, the schedules page, the
commands' outputs and the log lines; never by their workflow, ``k2b.task.<effect>``,
which every task of an effect shares.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import uuid

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.urls import reverse

from bench.overview import seed
from k2b_workflows import RateLimit, Schedule, cancel_workflow_run, counters, start_workflow_run
from k2b_workflows.admin import filters
from k2b_workflows.models import WorkflowRun
from k2b_workflows.tasks import schedule_task
from k2b_workflows.testing import crash_after_effect, run_until_idle
from tests.support.kernel import execute_exactly
from tests.support.processes import workflowstatus
from tests.tasks_app import fragile
from tests.tasks_app import tasks as t
from tests.tasks_app.tasks import EXTRA_ARGUMENTS, declared

pytest_plugins = ["k2b_workflows.pytest_plugin"]
pytestmark = pytest.mark.django_db(transaction=True)

ADD = "tests.tasks_app.tasks.add"
MAIL = "tests.tasks_app.tasks.mail"

if EXTRA_ARGUMENTS:

    @declared("idempotent", rate_limit=RateLimit(1, per=dt.timedelta(hours=1)))
    def rated(n):
        """One call an hour: a second call is deferred by the rate limit."""
        return n


def listed(admin_client, **query: str) -> set[str]:
    """The ids of the runs the runs list shows for ``query``."""
    response = admin_client.get(reverse("admin:k2b_workflows_workflowrun_changelist"), query)
    assert response.status_code == 200
    return {str(run.pk) for run in response.context["cl"].result_list}


def command(name: str, *args: str) -> str:
    out = io.StringIO()
    call_command(name, *args, stdout=out)
    return out.getvalue()


# -- the runs list ---------------------------------------------------------------------


def test_the_runs_list_filters_by_task_and_lists_the_paths_present(admin_client):
    add, mail = t.add.enqueue(1, 2), t.mail.enqueue("a@example.com")
    workflow = start_workflow_run("test.pure", {"a": 1, "b": 2})

    html = admin_client.get(reverse("admin:k2b_workflows_workflowrun_changelist")).content
    assert f"?task={ADD}".encode() in html and f"?task={MAIL}".encode() in html

    assert listed(admin_client, task=ADD) == {add.id}
    assert listed(admin_client, task=MAIL) == {mail.id}
    assert listed(admin_client) == {add.id, mail.id, str(workflow.pk)}


def test_the_runs_list_filters_by_queue(admin_client):
    add, mail = t.add.enqueue(1, 2), t.mail.enqueue("a@example.com")  # mail: queue "mail"
    workflow = start_workflow_run("test.pure", {"a": 1, "b": 2})

    html = admin_client.get(reverse("admin:k2b_workflows_workflowrun_changelist")).content
    assert b"?queue=mail" in html and b"?queue=default" in html
    assert listed(admin_client, queue="mail") == {mail.id}
    assert listed(admin_client, queue="default") == {add.id, str(workflow.pk)}


def test_searching_part_of_a_tasks_path_finds_its_calls(admin_client):
    charge = t.charge.enqueue("order-1")
    t.add.enqueue(1, 2)
    start_workflow_run("test.pure", {"a": 1, "b": 2})

    assert listed(admin_client, q="charge") == {charge.id}
    assert listed(admin_client, q="tests.tasks_app.tasks.charge") == {charge.id}


def test_the_runs_list_names_a_task_call_by_its_path_not_its_workflow(admin_client):
    t.mail.enqueue("a@example.com")
    html = admin_client.get(reverse("admin:k2b_workflows_workflowrun_changelist")).content
    assert MAIL.encode() in html and b"task, pure" in html
    # The workflow filter names the task workflows for what they hold.
    assert b"every pure task" in html and b">k2b.task.pure<" not in html


def test_a_task_calls_page_is_titled_by_its_path(admin_client):
    result = t.add.enqueue(1, 2)
    response = admin_client.get(reverse("admin:k2b_workflows_workflowrun_change", args=[result.id]))
    assert response.context["subtitle"] == f"{ADD} {result.id}"


def test_the_incident_queue_and_the_resolve_page_name_a_task_by_its_path(admin_client):
    result = t.external_noop.enqueue(1)
    with crash_after_effect(t.external_noop):
        run_until_idle()
    assert WorkflowRun.objects.get(pk=result.id).status == "needs_attention"

    queue = admin_client.get(reverse("admin:k2b_workflows_incident_changelist")).content.decode()
    resolve = admin_client.get(reverse("admin:k2b_workflows_incident_resolve", args=[result.id]))

    named = "tests.tasks_app.tasks.external_noop (task, external)"
    assert named in queue
    assert named in resolve.content.decode()


def test_the_schedules_page_names_a_tasks_schedule_by_its_path_and_finds_it(admin_client):
    schedule_task("hourly-add", t.add, Schedule(every=dt.timedelta(hours=1)), args=[1, 2])
    url = reverse("admin:k2b_workflows_workflowschedule_changelist")

    html = admin_client.get(url).content.decode()
    found = admin_client.get(url, {"q": "tasks.add"}).context["cl"].result_list

    assert f'<td class="field-name_column">{ADD}</td>' in html
    assert [s.schedule_id for s in found] == ["hourly-add"]


@pytest.mark.slow
def test_the_task_paths_are_read_through_their_index_one_descent_per_path():
    """60,000 runs, 30,000 of them calls of three tasks: the filter's list of paths is
    three descents of ``k2b_run_task_path``, never a scan of the table."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL session_replication_role = replica")
        cursor.execute("SELECT k2b_now()")
        seed(cursor, runs=60_000, recent=2_000, active=400, now=cursor.fetchone()[0])
        cursor.execute(
            "UPDATE k2b_run SET task_path = 'myapp.tasks.t' || (get_byte(uuid_send(id), 0) % 3)"
            " WHERE get_byte(uuid_send(id), 1) < 128"
        )
    with connection.cursor() as cursor:
        cursor.execute("VACUUM (ANALYZE) k2b_run")
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + filters.STATEMENTS["task_paths"], [200])
        plan = cursor.fetchone()[0][0]["Plan"]

    def nodes(plan: dict) -> list[dict]:
        return [plan, *(n for child in plan.get("Plans", []) for n in nodes(child))]

    types = [n["Node Type"] for n in nodes(plan)]
    assert "Seq Scan" not in types and "Bitmap Heap Scan" not in types, types
    scans = [n for n in nodes(plan) if n.get("Index Name") == "k2b_run_task_path"]
    assert scans and all(n["Actual Rows"] * n["Actual Loops"] <= 4 for n in scans), scans
    assert filters.task_paths() == ["myapp.tasks.t0", "myapp.tasks.t1", "myapp.tasks.t2"]


# -- the commands ------------------------------------------------------------------------


def test_workflowruns_and_workflowrun_show_name_a_task_call_by_its_path():
    result = t.mail.enqueue("a@example.com")

    listing = command("workflowruns")
    shown = command("workflowrun", "show", result.id)
    described = json.loads(command("workflowrun", "show", result.id, "--json"))["run"]

    assert MAIL in listing and "k2b.task" not in listing
    assert f"task      {MAIL} (task, pure) (queue mail, app tasks)" in shown
    assert (described["workflow"], described["task"], described["queue"]) == (
        "k2b.task.pure",
        MAIL,
        "mail",
    )


def test_workflowschedules_names_a_tasks_schedule_by_its_path():
    schedule_task("hourly-add", t.add, Schedule(every=dt.timedelta(hours=1)), args=[1, 2])

    text = command("workflowschedules")
    (row,) = json.loads(command("workflowschedules", "--json"))

    assert ADD in text and "k2b.task" not in text
    assert (row["workflow"], row["task"]) == ("k2b.task.pure", ADD)


def test_workflowstatus_names_the_task_of_a_late_schedule_and_of_unserved_calls(k2b_clock):
    schedule_task("minutely-add", t.add, Schedule(every=dt.timedelta(minutes=1)), args=[1, 2])
    t.mail.enqueue("a@example.com")  # no worker is live: nothing can run it
    k2b_clock.advance(minutes=3)

    code, _out, err = workflowstatus()
    report = json.loads(workflowstatus("--json")[1])

    assert code == 1
    assert f"LATE SCHEDULE minutely-add ({ADD} (task, pure))" in err
    assert f"NO LIVE WORKER for {MAIL} (task, pure) v1 (app tasks)" in err
    assert [(s["workflow"], s["task"]) for s in report["late_schedules"]] == [
        ("k2b.task.pure", ADD)
    ]
    assert [(u["workflow"], u["task"]) for u in report["unserved"]] == [("k2b.task.pure", MAIL)]


# -- the log lines -----------------------------------------------------------------------


def test_a_task_calls_log_lines_name_its_path(caplog):
    caplog.set_level(logging.INFO, logger="k2b_workflows.events")
    result = t.add.enqueue(1, 2)
    run_until_idle()

    mine = [r for r in caplog.records if getattr(r, "run_id", None) == result.id]
    assert mine and {r.workflow for r in mine} == {ADD}


def test_the_log_line_of_a_task_whose_code_is_gone_names_the_task_enqueued(caplog, monkeypatch):
    """Its result is read with a stand-in for the task: Django's "finished" line named
    the stand-in (``k2b_workflows.tasks.runs.missing_task``), not the task."""
    result = fragile.fragile.enqueue(1)
    monkeypatch.delattr(fragile, "fragile")  # renamed or removed since it was enqueued
    caplog.set_level(logging.INFO)

    cancel_workflow_run(result.id, "the task is gone")

    lines = [r.getMessage() for r in caplog.records if "path=" in r.getMessage()]
    assert lines and all("path=tests.tasks_app.fragile.fragile " in line for line in lines), lines


# -- the metrics -------------------------------------------------------------------------


@pytest.mark.skipif(not EXTRA_ARGUMENTS, reason="@task takes no rate_limit on Django 6.0")
def test_a_tasks_rate_limit_deferrals_are_counted_under_its_path(monkeypatch):
    """The label was the text before the key's first colon: "task", for every task."""
    labels: list[str] = []
    monkeypatch.setattr(counters, "count_rate_deferral", labels.append)
    first, second = rated.enqueue(1), rated.enqueue(2)

    assert execute_exactly(uuid.UUID(first.id)) == "succeeded"
    assert execute_exactly(uuid.UUID(second.id)) == "deferred"
    assert labels == ["task:tests.admin.test_task_names.rated"]
