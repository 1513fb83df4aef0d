"""The witness catches what no check inside the database can: a rollback and a deletion (#30).

The review's attack H2, verbatim, as the tables' owner without the evidence
key: save a queued run's anchors, let it charge, delete its journal, ledger
and charges, write the saved anchors back and queue it. The replay charges a
second time and every chain and seal in the database verifies, because the
database is exactly as it was before the run started. The witness log the
workers wrote outside it is what ``verifyworkflows --witness`` holds it against.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pgtrigger
import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import override_settings

from k2b_workflows import start_workflow_run
from k2b_workflows.kernel import witness
from k2b_workflows.models import WorkflowRun
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall

pytestmark = pytest.mark.django_db(transaction=True)

_OWNER_BYPASS = (
    "k2b_workflows.JournalEntry:journal_append_only",
    "k2b_workflows.LedgerEntry:ledger_append_only",
    "k2b_workflows.BudgetCharge:charge_append_only",
    "k2b_workflows.WorkflowRun:status_transitions",
)


@pytest.fixture
def witness_log(tmp_path: Path) -> Iterator[Path]:
    """The witness logger written to a file, as a host ships it to a log store."""
    path = tmp_path / "witness.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    log = logging.getLogger("k2b_workflows.witness")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield path
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        handler.close()


def _verify(*witness_files: Path) -> tuple[bool, str]:
    out = io.StringIO()
    args = [arg for path in witness_files for arg in ("--witness", str(path))]
    try:
        call_command("verifyworkflows", *args, stdout=out)
    except CommandError as exc:
        return False, out.getvalue() + str(exc)
    return True, out.getvalue()


def _amounts() -> list[int]:
    return [c.payload["amount"] for c in ProviderCall.objects.filter(action="test.charge")]


def test_a_rolled_back_run_repeats_its_charge_unseen_inside_the_database_and_the_witness_sees_it(
    witness_log,
):
    run = start_workflow_run("test.charge", {"amount": 7})
    saved = WorkflowRun.objects.filter(pk=run.pk).values().get()
    run_until_idle()
    assert _amounts() == [7]
    # The owner rolls the run back to before it started.
    with pgtrigger.ignore(*_OWNER_BYPASS), connection.cursor() as cursor:
        for table in ("k2b_budget_charge", "k2b_ledger", "k2b_journal"):
            cursor.execute(f"DELETE FROM {table} WHERE run_id = %s", [run.pk])
        cursor.execute("UPDATE k2b_budget_account SET spent = '{}' WHERE root_id = %s", [run.pk])
        cursor.execute(
            """UPDATE k2b_run SET status = 'queued', output = NULL, end_seal = %s,
                      journal_anchor = %s, ledger_anchor = %s, finished_at = NULL
                WHERE id = %s""",
            [saved["end_seal"], saved["journal_anchor"], saved["ledger_anchor"], run.pk],
        )
    run_until_idle()
    assert _amounts() == [7, 7]  # the effect repeated...
    ok, out = _verify()
    assert ok, out  # ...and nothing in the database can tell
    ok, out = _verify(witness_log)
    assert not ok
    assert f"WITNESS {run.pk}" in out and "rolled back or restored" in out
    assert "1 not held" in out


def test_a_deleted_run_is_found_by_the_witness(witness_log):
    kept = start_workflow_run("test.charge", {"amount": 1})
    gone = start_workflow_run("test.charge", {"amount": 2})
    run_until_idle()
    assert _verify(witness_log)[0]
    with pgtrigger.ignore(*_OWNER_BYPASS), connection.cursor() as cursor:
        for table in ("k2b_budget_charge", "k2b_ledger", "k2b_journal"):
            cursor.execute(f"DELETE FROM {table} WHERE run_id = %s", [gone.pk])
        cursor.execute("DELETE FROM k2b_budget_account WHERE root_id = %s", [gone.pk])
        cursor.execute("DELETE FROM k2b_run WHERE id = %s", [gone.pk])
    ok, out = _verify(witness_log)
    assert not ok
    assert f"WITNESS {gone.pk}" in out and "no longer exists" in out
    assert str(kept.pk) not in out


def test_a_forged_witness_line_is_reported_not_believed(witness_log, tmp_path):
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    run_until_idle()
    forged = tmp_path / "forged.log"
    line = next(line for line in witness_log.read_text().splitlines() if str(run.pk) in line)
    forged.write_text(line.replace('"ledger": 0', '"ledger": 5') + "\n")
    ok, out = _verify(forged)
    assert not ok and "mac does not verify" in out


def test_the_dispatch_is_witnessed_before_the_provider_is_called():
    told: list[tuple[dict, int]] = []

    def sink(record: dict) -> None:
        told.append((record, ProviderCall.objects.count()))

    with override_settings(K2B_WORKFLOWS={**settings.K2B_WORKFLOWS, "WITNESS_SINK": sink}):
        run = start_workflow_run("test.charge", {"amount": 3})
        run_until_idle()
    kinds = [(r["kind"], calls) for r, calls in told if r["run"] == str(run.pk)]
    assert kinds == [("dispatch", 0), ("end", 1)]


def test_a_failing_sink_never_stops_a_run(caplog):
    def sink(record: dict) -> None:
        raise OSError("log store unreachable")

    with override_settings(K2B_WORKFLOWS={**settings.K2B_WORKFLOWS, "WITNESS_SINK": sink}):
        run = start_workflow_run("test.charge", {"amount": 3})
        run_until_idle()
    run.refresh_from_db()
    assert run.status == "succeeded"
    assert "the witness sink failed" in caplog.text


def test_witness_records_inside_json_log_lines_are_read(witness_log, tmp_path):
    run = start_workflow_run("test.pure", {"a": 1, "b": 2})
    run_until_idle()
    as_json = tmp_path / "json.log"
    with as_json.open("w") as f:
        for line in witness_log.read_text().splitlines():
            message = line[line.index(witness.MARK) :]
            f.write(json.dumps({"level": "INFO", "message": message}) + "\n")
    records = [r for r in witness.parse(as_json.read_text().splitlines()) if isinstance(r, dict)]
    assert any(r["run"] == str(run.pk) and r["kind"] == "end" for r in records)
    assert _verify(as_json)[0]


def test_verifyworkflows_names_a_missing_witness_file(tmp_path):
    with pytest.raises(CommandError, match=r"--witness .*nope"):
        call_command("verifyworkflows", "--witness", str(tmp_path / "nope"))


def test_runs_purged_by_retention_are_not_reported(witness_log):
    import datetime as dt

    from k2b_workflows.retention import purge_finished_runs

    run = start_workflow_run("test.charge", {"amount": 4})
    run_until_idle()
    WorkflowRun.objects.filter(pk=run.pk).update(
        finished_at=WorkflowRun.objects.get(pk=run.pk).finished_at - dt.timedelta(days=30)
    )
    assert purge_finished_runs(older_than=dt.timedelta(days=1))["run trees"] == 1
    ok, out = _verify(witness_log)
    assert ok, out
