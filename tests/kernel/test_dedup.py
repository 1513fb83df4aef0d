"""``insert_once`` on tables with two unique constraints: every case told apart, never a 23505."""

from __future__ import annotations

import threading

import pytest
from django.db import IntegrityError, connections

from k2b_workflows import start_workflow_run
from k2b_workflows.dedup import DedupConflict, insert_once
from k2b_workflows.models import DedupRecord
from tests.models import Dedup

pytestmark = pytest.mark.django_db(transaction=True)

VALUES = {"run": "r1", "step": 0, "recipient": "ann@example.com"}


def test_first_insert_creates_the_row():
    row, created = insert_once(Dedup, "k1", **VALUES)
    assert created is True
    assert Dedup.objects.get(key="k1").pk == row.pk


def test_same_key_and_values_return_the_existing_row():
    first, _ = insert_once(Dedup, "k1", **VALUES)
    again, created = insert_once(Dedup, "k1", **VALUES)
    assert (again.pk, created) == (first.pk, False)
    assert Dedup.objects.count() == 1


def test_same_key_with_other_values_is_a_conflict():
    insert_once(Dedup, "k1", **VALUES)
    with pytest.raises(DedupConflict, match="recipient"):
        insert_once(Dedup, "k1", **{**VALUES, "recipient": "bob@example.com"})
    assert Dedup.objects.get(key="k1").recipient == "ann@example.com"


def test_another_key_holding_the_run_step_recipient_constraint_is_a_conflict():
    insert_once(Dedup, "k1", **VALUES)
    with pytest.raises(DedupConflict, match="another row"):
        insert_once(Dedup, "k2", **VALUES)
    assert not Dedup.objects.filter(key="k2").exists()


def _race(fn, n: int) -> list:
    barrier = threading.Barrier(n)
    results: list = []

    def body() -> None:
        try:
            barrier.wait()
            results.append(fn())
        except BaseException as exc:  # collected, asserted by the test
            results.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=body) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_concurrent_identical_calls_create_one_row_and_never_raise_integrity_error():
    for round_ in range(5):
        key = f"race-{round_}"
        results = _race(lambda key=key: insert_once(Dedup, key, **{**VALUES, "run": key}), 8)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors
        assert sum(1 for _, created in results if created) == 1
        assert len({row.pk for row, _ in results}) == 1
    assert Dedup.objects.count() == 5


def test_concurrent_calls_with_other_keys_on_one_constraint_conflict_cleanly():
    results = _race(lambda: insert_once(Dedup, f"k-{threading.get_ident()}", **VALUES), 6)
    assert not [r for r in results if isinstance(r, IntegrityError)]
    created = [r for r in results if isinstance(r, tuple)]
    conflicts = [r for r in results if isinstance(r, DedupConflict)]
    assert len(created) == 1 and len(conflicts) == 5
    assert Dedup.objects.count() == 1


def test_the_apps_dedup_record_uses_the_same_rules():
    run = start_workflow_run("test.pure", {"a": 1, "b": 1})
    row, created = insert_once(
        DedupRecord, "mail:1", run=run, step=0, name="welcome", value={"to": "ann"}
    )
    assert created
    again, created = insert_once(
        DedupRecord, "mail:1", run=run, step=0, name="welcome", value={"to": "ann"}
    )
    assert (again.pk, created) == (row.pk, False)
    with pytest.raises(DedupConflict):
        insert_once(DedupRecord, "mail:2", run=run, step=0, name="welcome", value={"to": "ann"})
    with pytest.raises(DedupConflict):
        insert_once(DedupRecord, "mail:1", run=run, step=0, name="welcome", value={"to": "bob"})
    assert DedupRecord.objects.count() == 1


def _djangos_params(obj, connection):
    """``obj``'s columns as Django's own ``pre_save`` and ``get_db_prep_save`` make them."""
    from k2b_workflows.dedup import insert_fields

    return [
        f.get_db_prep_save(f.pre_save(obj, add=True), connection) for f in insert_fields(type(obj))
    ]


def _same(ours, djangos):
    """Two parameter lists alike, as psycopg would send them (``Jsonb`` by its object)."""
    assert len(ours) == len(djangos)
    for a, b in zip(ours, djangos, strict=True):
        assert type(a) is type(b)
        assert getattr(a, "obj", a) == getattr(b, "obj", b)


def test_insert_params_are_djangos_for_a_task_run_a_child_and_a_budget_account():
    """The plain fields' short cut (``dedup._plain``) gives what Django's path gives,
    column by column and type by type, on the rows an enqueue and a step's children
    insert (#52)."""
    import datetime as dt

    from k2b_workflows.dedup import insert_params
    from k2b_workflows.kernel import starts
    from k2b_workflows.models import BudgetAccount
    from k2b_workflows.tasks import runs  # noqa: F401  (registers the task workflows)
    from k2b_workflows.workflows import get_workflow

    connection = connections["default"]
    now = dt.datetime.now(dt.UTC)
    definition = get_workflow("k2b.task.pure")
    run = starts.new_run(
        definition, {"args": [1], "kwargs": {}}, now=now, priority=3, concurrency_key="k"
    )
    child = starts.new_run(definition, {}, now=now, parent=run, parent_step=2, child_index=0)
    naive = starts.new_run(definition, {}, now=now)
    naive.scheduled_for = dt.datetime(2026, 1, 1)  # naive: Django's path, and its warning
    budget = BudgetAccount(
        root_id=run.id, effect_budget={"usd": 3}, max_ai_calls=2, max_steps=None, limits_seal="s"
    )
    for obj in (run, child, budget):
        _same(insert_params(obj, connection), _djangos_params(obj, connection))
    with pytest.warns(RuntimeWarning):
        ours = insert_params(naive, connection)
    with pytest.warns(RuntimeWarning):
        _same(ours, _djangos_params(naive, connection))


def test_unsaved_builds_the_instance_django_builds_from_keywords():
    """``starts.unsaved`` (positional, as a row read back) gives what ``Model(**values)``
    gives: every column, defaults included, and a new unsaved state (#52)."""
    import datetime as dt
    import uuid

    from k2b_workflows.kernel import starts
    from k2b_workflows.models import BudgetAccount, WorkflowRun

    now = dt.datetime.now(dt.UTC)
    run_id = uuid.uuid4()
    values = {
        "id": run_id,
        "workflow_name": "w",
        "workflow_version": 2,
        "app_id": "a",
        "status": "queued",
        "input": {"x": [1]},
        "created_at": now,
        "updated_at": now,
        "run_after": now,
        "root_id": run_id,
        "priority": 3,
    }
    for model, given in (
        (WorkflowRun, values),
        (BudgetAccount, {"root_id": run_id, "effect_budget": {"usd": 1}, "max_steps": 4}),
    ):
        ours, djangos = starts.unsaved(model, dict(given)), model(**given)
        for field in model._meta.concrete_fields:
            assert getattr(ours, field.attname) == getattr(djangos, field.attname), field.name
        assert (ours._state.adding, ours._state.db) == (True, None)
    # A default that is a callable is called for each instance, not shared.
    first, second = starts.unsaved(BudgetAccount, {}), starts.unsaved(BudgetAccount, {})
    assert first.effect_budget == second.effect_budget
    assert first.effect_budget is not second.effect_budget or first.effect_budget is None
    with pytest.raises(TypeError, match="unexpected columns: root, typo"):
        starts.unsaved(WorkflowRun, {"typo": 1, "root": None, "id": run_id})
