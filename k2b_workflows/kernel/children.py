"""Child runs: created once per parent step, counted against the root's loop budget."""

from __future__ import annotations

import uuid
from typing import Any

from .. import tracing
from ..actions import Dependency
from ..models import TERMINAL_STATUSES, RunStatus, WorkflowRun
from . import budgets, clock, db, evidence, seals, waits

KIND = "k2b.children"
#: The app of a child's parent: where the wake of its children step goes.
PARENT_APP_SQL = "SELECT app_id FROM k2b_run WHERE id = %s"


def dependency(parent_id: uuid.UUID, step: int) -> Dependency:
    """What a parent waits on while its children of one step run."""
    return Dependency(KIND, f"{parent_id}:{step}")


def create(
    using: str, *, parent: WorkflowRun, step: int, name: str, inputs: list[Any]
) -> list[Any]:
    """Create the children of ``parent``'s step ``step`` that do not exist yet.

    Idempotent: a replayed parent finds its children by (parent, step, index)
    and creates none twice. The caller holds the parent's fence. Raises
    ``UnknownWorkflow`` or ``budgets.BudgetExceeded`` before creating anything.
    Returns the ids of all children of that step, in input order.
    """
    from ..workflows import get_workflow

    definition = get_workflow(name)
    existing = dict(
        db.fetchall(
            using,
            "SELECT child_index, id FROM k2b_run WHERE parent_id = %s AND parent_step = %s",
            [parent.id, step],
        )
    )
    missing = [i for i in range(len(inputs)) if i not in existing]
    root_id = parent.root_id or parent.id
    budgets.reserve_children(using, root_id=root_id, count=len(missing))
    now = clock.now()
    trace_context = tracing.child_context(parent.trace_context)
    new_ids = {i: uuid.uuid4() for i in missing}
    rows = [
        WorkflowRun(
            id=new_ids[i],
            workflow_name=definition.name,
            workflow_version=definition.version,
            app_id=definition.app_id,
            status=RunStatus.QUEUED,
            input=inputs[i],
            principal=parent.principal,
            parent_id=parent.id,
            parent_step=step,
            child_index=i,
            root_id=root_id,
            run_after=now,
            created_at=now,
            updated_at=now,
            # The creating step's span: the children's spans nest under it.
            trace_context=trace_context,
            timeout_at=definition.timeout_at(now),
            **evidence.initial_anchors(new_ids[i]),
        )
        for i in missing
    ]
    for row in rows:
        row.start_seal = seals.start_seal(row)
    WorkflowRun.objects.using(using).bulk_create(rows, ignore_conflicts=True)
    existing.update({row.child_index: row.id for row in rows})
    return [existing[i] for i in range(len(inputs))]


def results(using: str, parent_id: uuid.UUID, step: int) -> list[dict[str, Any]]:
    """The children of one parent step, in input order, with whether each has ended.

    A child that has ended is checked against its end seal before its parent may
    use its result: raises ``seals.SealBroken`` for a status, output or error code
    that the kernel did not write.
    """
    rows = db.fetchall(
        using,
        """SELECT id, status, output, error_code, generation, end_seal FROM k2b_run
            WHERE parent_id = %s AND parent_step = %s ORDER BY child_index""",
        [parent_id, step],
    )
    found = []
    for run_id, status, output, code, generation, end_seal in rows:
        value = db.from_json(output)
        done = status in TERMINAL_STATUSES
        if done:
            child = WorkflowRun(
                id=run_id,
                status=status,
                output=value,
                error_code=code,
                generation=generation,
                end_seal=end_seal,
            )
            problem = seals.end_problem(child)
            if problem:
                raise seals.SealBroken(f"child run {run_id}: {problem}")
        found.append(
            {
                "run_id": str(run_id),
                "status": status,
                "output": value,
                "error_code": code,
                "done": done,
            }
        )
    return found


def public(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in ("status", "output", "error_code", "run_id")}


def count(using: str, run_id: uuid.UUID) -> dict[str, int]:
    """Children of ``run_id`` per status, every status present, in one query."""
    counts = {status: 0 for status in RunStatus.values}
    for status, n in db.fetchall(
        using,
        "SELECT status, count(*) FROM k2b_run WHERE parent_id = %s GROUP BY status",
        [run_id],
    ):
        counts[status] = n
    counts["total"] = sum(counts[s] for s in RunStatus.values)
    return counts


def wake_parent(using: str, run: WorkflowRun) -> None:
    """A child ended: wake its parent's children step (inside the child's transaction)."""
    if run.parent_id is None or run.parent_step is None:
        return  # not a child
    rows = db.fetchall(using, PARENT_APP_SQL, [run.parent_id])
    if rows:
        dep = dependency(run.parent_id, run.parent_step)
        waits.wake(using, app_id=rows[0][0], kind=dep.kind, key=dep.key)
