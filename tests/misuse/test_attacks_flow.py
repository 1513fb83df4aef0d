"""Attacks by the runtime role on flow control and budgets (#35).

Each test connects as a fresh role holding exactly what ``grantworkflows``
grants (``tests/runtime_role.py``), as a SQL injection in the host app would,
and tries to make an effect happen more often than the key holder allowed:
more runs of a limit-1 key inside the action at once, more dispatches than a
rate limit lets through, more charges than a budget. What decides it is either
out of the role's reach (column privileges, SECURITY DEFINER functions that
take no limit from their caller) or refused when it is used.
"""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, connections, transaction

from k2b_workflows import start_workflow_run
from k2b_workflows.kernel import claim, db
from k2b_workflows.kernel.execute import Execution
from k2b_workflows.models import WorkflowRun
from k2b_workflows.testing import run_until_idle
from tests.models import ProviderCall
from tests.support import runtime_role
from tests.support.runtime_role import RUNTIME, as_runtime, refused

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", RUNTIME])

runtime = runtime_role.runtime

ONE = "flow.one_at_a_time"


def claimable(*names: str, limit: int = 10) -> list:
    """What a worker with room for ``limit`` would take now: the runs it would put inside
    the action."""
    with transaction.atomic(using=RUNTIME):
        rows = claim.claim_runs(
            RUNTIME,
            worker_id="attack",
            workflows=[(n, 1) for n in names],
            app_ids=None,
            limit=limit,
        )
    return [row[0] for row in rows]


def attempt(sql: str, params: list | None = None) -> str | None:
    """Run ``sql`` as the runtime role; the SQLSTATE it failed with, or None if it ran."""
    try:
        as_runtime(sql, params)
    except DatabaseError as exc:
        return db.sqlstate(exc)
    return None


@pytest.fixture
def three_on_one_key(runtime) -> list[WorkflowRun]:
    """Three runs of a limit-1 key, started by the kernel as the runtime role; one holds it."""
    runs = [start_workflow_run(ONE, {"key": "k", "nap": 0}, concurrency_key="k") for _ in range(3)]
    assert [r.holds_slot for r in runs] == [True, False, False]
    return runs


# -- concurrency slots --------------------------------------------------------------


def test_setting_holds_slot_puts_no_second_run_inside_a_limit_1_key(three_on_one_key):
    refused("UPDATE k2b_run SET holds_slot = true WHERE concurrency_key = 'k'")
    assert claimable(ONE) == [three_on_one_key[0].pk]


@pytest.mark.parametrize(
    "call",
    [
        "SELECT k2b_flow_admit('flow.one_at_a_time', 'k', 1000)",
        "SELECT k2b_flow_admit('flow.one_at_a_time', 'k')",
    ],
)
def test_calling_the_admission_admits_no_more_than_the_limit(three_on_one_key, call):
    """EXECUTE on the admission is granted (the slot triggers call it as the runtime role):
    it must take no limit from its caller."""
    attempt(call)
    assert claimable(ONE) == [three_on_one_key[0].pk]


@pytest.mark.parametrize(
    "change",
    [
        "concurrency_key = NULL",
        "concurrency_key = 'elsewhere-' || id::text",
        "concurrency_limit = 1000",
        "workflow_name = 'flow.keyed'",
    ],
)
def test_moving_a_run_off_its_key_is_refused(three_on_one_key, change):
    refused(f"UPDATE k2b_run SET {change} WHERE concurrency_key = 'k' AND NOT holds_slot")
    assert claimable(ONE) == [three_on_one_key[0].pk]


def test_an_inserted_run_holding_a_slot_is_refused(three_on_one_key):
    refused(
        "INSERT INTO k2b_run SELECT (json_populate_record(r, json_build_object("
        "'id', gen_random_uuid(), 'holds_slot', true))).* FROM k2b_run r WHERE id = %s",
        [three_on_one_key[1].pk],
    )
    assert claimable(ONE) == [three_on_one_key[0].pk]


def test_an_inserted_run_with_a_limit_of_1000_admits_nobody(three_on_one_key):
    """Admission reads the limit from the rows, never a caller's: an inserted row can
    only lower it, and the first holder's limit of 1 holds."""
    first = three_on_one_key[0]
    as_runtime(
        "INSERT INTO k2b_run SELECT (json_populate_record(r, json_build_object("
        "'id', gen_random_uuid(), 'concurrency_limit', 1000, 'holds_slot', false,"
        " 'idempotency_key', NULL, 'created_at', '2000-01-01T00:00:00Z',"
        " 'run_after', '2000-01-01T00:00:00Z'))).* FROM k2b_run r WHERE id = %s",
        [three_on_one_key[1].pk],
    )
    assert claimable(ONE) == [first.pk]
    assert WorkflowRun.objects.filter(concurrency_key="k", holds_slot=True).count() == 1


def test_holds_slot_on_a_finished_run_is_refused_and_healed_when_the_owner_sets_it(runtime):
    done = start_workflow_run(ONE, {"key": "f", "nap": 0}, concurrency_key="f")
    run_until_idle(using=RUNTIME)
    assert WorkflowRun.objects.get(pk=done.pk).status == "succeeded"
    refused("UPDATE k2b_run SET holds_slot = true WHERE id = %s", [done.pk])
    # The owner can: the housekeeping frees a slot no live action holds.
    with connection.cursor() as cursor:
        cursor.execute("UPDATE k2b_run SET holds_slot = true WHERE id = %s", [done.pk])
    nxt = start_workflow_run(ONE, {"key": "f", "nap": 0}, concurrency_key="f")
    assert not nxt.holds_slot
    with transaction.atomic(using=RUNTIME):
        claim.reap_expired(RUNTIME)
    assert WorkflowRun.objects.get(pk=nxt.pk).holds_slot
    assert not WorkflowRun.objects.get(pk=done.pk).holds_slot


def test_the_runtime_role_holds_no_privilege_beyond_the_grants(runtime):
    from k2b_workflows.roles import excess_privileges

    assert excess_privileges(RUNTIME) == []
    with connections[RUNTIME].cursor() as cursor:
        cursor.execute(
            "SELECT has_column_privilege(current_user, 'k2b_run', 'holds_slot', 'UPDATE'),"
            " has_column_privilege(current_user, 'k2b_run', 'status', 'UPDATE')"
        )
        assert cursor.fetchone() == (False, True)


# -- rate-limit stamps ----------------------------------------------------------------

TWICE = "flow.rated_twice_an_hour"


def _dispatched() -> int:
    return ProviderCall.objects.filter(action=TWICE).count()


def drain(*names: str, between: str | None = None) -> None:
    """Claim and execute, as the runtime role, one by one, every run of ``names`` due now
    (deferred ones, a full rate limit, are due again only in an hour); ``between``: a
    statement the runtime role runs after each."""
    while claimed := claimable(*names, limit=1):
        for run_id in claimed:
            generation = WorkflowRun.objects.get(pk=run_id).generation
            Execution(run_id, generation, using=RUNTIME).execute()
            if between:
                attempt(between)


def _due_again() -> None:
    """Every deferred run due now (the runtime role may move run_after: it is not a limit)."""
    as_runtime("UPDATE k2b_run SET run_after = k2b_now() WHERE status = 'queued'")


@pytest.mark.parametrize(
    "attack",
    [
        "DELETE FROM k2b_rate_dispatch",
        "UPDATE k2b_rate_dispatch SET at = '2000-01-01T00:00:00Z'",
        "UPDATE k2b_rate_dispatch SET limit_key = 'elsewhere'",
        # A caller's short window must delete nothing admitted under a longer one.
        "SELECT * FROM k2b_rate_admit('flow.rated_twice_an_hour', 1000, 1,"
        " gen_random_uuid(), 0, 0)",
    ],
)
def test_the_rate_stamps_hold_a_2_per_hour_limit(runtime, attack):
    runs = [start_workflow_run(TWICE, {"n": i}) for i in range(4)]
    drain(TWICE)
    assert _dispatched() == 2
    attempt(attack)
    _due_again()
    drain(TWICE)
    assert _dispatched() == 2
    statuses = sorted(
        WorkflowRun.objects.filter(pk__in=[r.pk for r in runs]).values_list("status", flat=True)
    )
    assert statuses == ["queued", "queued", "succeeded", "succeeded"]


def test_the_runtime_role_may_only_read_the_rate_stamps(runtime):
    start_workflow_run(TWICE, {"n": 0})
    drain(TWICE)
    refused("DELETE FROM k2b_rate_dispatch")
    refused("UPDATE k2b_rate_dispatch SET at = NULL")
    refused(
        "INSERT INTO k2b_rate_dispatch (limit_key, reserved_at, run_id, seq, generation)"
        " VALUES ('x', now(), gen_random_uuid(), 0, 0)"
    )


# -- budgets ------------------------------------------------------------------------------

TREE = ("fanout.budget_3", "fanout.send_one")


@pytest.mark.parametrize(
    "attack",
    [
        """UPDATE k2b_budget_account SET effect_budget = '{"sends": 100}'""",
        # After every step: what was spent is summed from the charges, not read back.
        """UPDATE k2b_budget_account SET spent = '{}'""",
    ],
)
def test_a_tree_budget_of_3_lets_3_emails_through_whatever_the_account_says(runtime, attack):
    root = start_workflow_run("fanout.budget_3", {"n": 5})
    attempt(attack)
    drain(*TREE, between=attack)
    sends = ProviderCall.objects.filter(action="fanout.send").count()
    assert sends == 3
    assert sorted(WorkflowRun.objects.get(pk=root.pk).output) == (
        ["EFFECT_BUDGET_EXCEEDED"] * 2 + ["succeeded"] * 3
    )


def test_the_runtime_role_cannot_raise_a_budget(runtime):
    start_workflow_run("fanout.budget_3", {"n": 1})
    refused("""UPDATE k2b_budget_account SET effect_budget = '{"sends": 100}'""")
    refused("UPDATE k2b_budget_account SET max_ai_calls = 100")
    refused("UPDATE k2b_budget_account SET max_steps = 100")


# -- verifyworkflows ------------------------------------------------------------------


def _verify() -> tuple[bool, str]:
    out = io.StringIO()
    try:
        call_command("verifyworkflows", stdout=out)
    except CommandError as exc:
        return False, out.getvalue() + str(exc)
    return True, out.getvalue()


@pytest.mark.parametrize(
    ("owner_sql", "said"),
    [
        (
            "UPDATE k2b_run SET holds_slot = true WHERE concurrency_key = 'k'",
            "3 runs hold a slot, its limit is 1",
        ),
        (
            "UPDATE k2b_run SET holds_slot = true, concurrency_key = NULL"
            " WHERE concurrency_key = 'k' AND NOT holds_slot",
            "holds a slot without a concurrency key",
        ),
    ],
)
def test_verifyworkflows_names_tampered_slots(three_on_one_key, owner_sql, said):
    assert _verify()[0]
    # Beyond the runtime role's reach now: the owner, or a role granted more.
    with connection.cursor() as cursor:
        cursor.execute(owner_sql)
    ok, out = _verify()
    assert not ok and "FLOW " in out and said in out, out


def test_verifyworkflows_names_a_finished_run_holding_a_slot(runtime):
    done = start_workflow_run(ONE, {"key": "f", "nap": 0}, concurrency_key="f")
    drain(ONE)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE k2b_run SET holds_slot = true WHERE id = %s", [done.pk])
    ok, out = _verify()
    assert not ok and f"FLOW {done.pk} {ONE} (succeeded): ended" in out, out


def test_verifyworkflows_names_spending_that_is_not_its_charges(runtime):
    root = start_workflow_run("fanout.budget_3", {"n": 2})
    drain(*TREE)
    assert _verify()[0]
    as_runtime("UPDATE k2b_budget_account SET spent = '{}' WHERE root_id = %s", [root.pk])
    ok, out = _verify()
    assert not ok and f"FLOW budget of {root.pk}: spent {{}}" in out, out


def test_max_ai_calls_holds_whatever_the_ai_calls_counter_says(runtime):
    """The counter is display only: an AI task is refused on the count of its charges."""
    root = start_workflow_run("fanout.ai_twice", {})
    as_runtime("UPDATE k2b_budget_account SET ai_calls = -5 WHERE root_id = %s", [root.pk])
    run_until_idle(app_ids=["fanout"], using=RUNTIME)
    root = WorkflowRun.objects.get(pk=root.pk)
    assert (root.status, root.error_code) == ("failed", "EFFECT_BUDGET_EXCEEDED")
    assert ProviderCall.objects.filter(action="ai.echo").count() == 1


def test_the_owners_raised_budget_charges_nothing_more_and_verifyworkflows_names_it(runtime):
    """The table's owner can change a limit the runtime role cannot (#47): a budget of 3
    raised to 100 before the tree ran let every send through, and nothing said so.
    The limits are sealed with the account: a charge refuses the changed ones before
    anything is sent, and ``verifyworkflows`` names the account."""
    root = start_workflow_run("fanout.budget_3", {"n": 5})
    with connection.cursor() as cursor:
        cursor.execute(
            """UPDATE k2b_budget_account SET effect_budget = '{"sends": 100}' WHERE root_id = %s""",
            [root.pk],
        )
    ok, out = _verify()
    assert not ok and f"FLOW the budget limits of {root.pk}" in out, out
    assert "does not match its seal" in out, out
    drain(*TREE)
    # Refused at the first charge of the tree (its children's), before any send.
    assert ProviderCall.objects.filter(action="fanout.send").count() == 0
    ended = WorkflowRun.objects.get(pk=root.pk)
    assert (ended.status, ended.error_code) == ("failed", "INTEGRITY_CHAIN_BROKEN")
    assert "changed after the run started" in ended.error_message, ended.error_message


def test_the_runtime_role_cannot_blank_the_limits_seal(runtime):
    start_workflow_run("fanout.budget_3", {"n": 1})
    refused("UPDATE k2b_budget_account SET limits_seal = ''")
