"""A start: one statement for the run and its budget account, whatever Django's
cursor class, and a failure that marks the caller's atomic block for rollback."""

from __future__ import annotations

import pytest
from django.db import connection

from k2b_workflows import start_workflow_run
from k2b_workflows.models import WorkflowRun
from tests.hot_path.helpers import _round_trips
from tests.support.kernel import fresh

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_start_is_one_transaction_and_returns_the_run_as_stored():
    """The run and its budget account in one statement, in autocommit its own
    transaction: one round trip, where BEGIN, two inserts, COMMIT and a read back
    took five. The instance returned is the row, field by field."""
    with _round_trips() as counted:
        run = start_workflow_run(
            "hot.three_pure", {"n": 1.5, "deep": [1, {"b": None, "a": "x"}]}, principal={"u": 7}
        )
    assert counted == [1]
    stored = fresh(run)
    for field in WorkflowRun._meta.concrete_fields:
        assert getattr(run, field.attname) == getattr(stored, field.attname), field
    assert not run._state.adding and run._state.db == "default"


@pytest.mark.parametrize("binding", ["client", "server"])
def test_a_start_stores_the_budget_and_the_parent_whatever_djangos_cursor_class(request, binding):
    """The account's values go in a SELECT (inserted only with the run): their types
    come from the columns whether Django binds on the client or on the server."""
    from k2b_workflows.models import BudgetAccount

    if binding == "server":
        request.getfixturevalue("server_side_binding")
    root = start_workflow_run("test.charge", {"amount": 5})
    account = BudgetAccount.objects.get(root_id=root.pk)
    assert account.effect_budget == {"charges": 2} and account.spent == {}
    assert account.max_ai_calls is None and account.ai_calls == 0
    limited = start_workflow_run("fanout.ai", {})
    assert BudgetAccount.objects.get(root_id=limited.pk).max_ai_calls == 1
    child = start_workflow_run("hot.three_pure", {"n": 0}, parent=root.pk)
    assert fresh(child).parent_id == root.pk and fresh(child).root_id == root.pk
    assert not BudgetAccount.objects.filter(root_id=child.pk).exists()


def test_a_start_that_fails_inside_an_atomic_block_marks_it_for_rollback():
    """As Django's ``create()``: the block cannot go on as if nothing happened, and the
    run and its account are both gone with it."""
    from django.db import DatabaseError, transaction

    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION k2b_test_refuse() RETURNS trigger LANGUAGE plpgsql"
            " AS $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$"
        )
        cursor.execute(
            "CREATE TRIGGER k2b_test_refuse BEFORE INSERT ON k2b_budget_account"
            " FOR EACH ROW EXECUTE FUNCTION k2b_test_refuse()"
        )
    try:
        with transaction.atomic():
            with pytest.raises(DatabaseError, match="refused by the test"):
                start_workflow_run("hot.three_pure", {"n": 0})
            assert connection.needs_rollback
        assert not WorkflowRun.objects.exists()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER k2b_test_refuse ON k2b_budget_account")
            cursor.execute("DROP FUNCTION k2b_test_refuse()")
