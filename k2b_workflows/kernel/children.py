"""Child runs: what a parent waits on, their results, their counts, and the wake of their parent.

They are created by ``starts.start_children``, once per parent step.
"""

from __future__ import annotations

import uuid
from typing import Any

from ..actions import Dependency
from ..models import TERMINAL_STATUSES, RunStatus, WorkflowRun
from . import db, seals, waits

KIND = "k2b.children"
#: The app of a child's parent: where the wake of its children step goes.
PARENT_APP_SQL = "SELECT app_id FROM k2b_run WHERE id = %s"


def dependency(parent_id: uuid.UUID, step: int) -> Dependency:
    """What a parent waits on while its children of one step run."""
    return Dependency(KIND, f"{parent_id}:{step}")


_CHILDREN_OF_STEP_SQL = """
SELECT id, status, output, error_code, generation, end_seal FROM k2b_run
WHERE parent_id = %s AND parent_step = %s ORDER BY child_index
"""


def results(using: str, parent_id: uuid.UUID, step: int) -> list[dict[str, Any]]:
    """The children of one parent step, in input order, with whether each has ended.

    A child that has ended is checked against its end seal before its parent may
    use its result: raises ``seals.SealBroken`` for a status, output or error code
    that the kernel did not write.
    """
    rows = db.fetchall(
        using,
        _CHILDREN_OF_STEP_SQL,
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


_CHILDREN_BY_STATUS_SQL = (
    "SELECT status, count(*) FROM k2b_run WHERE parent_id = %s GROUP BY status"
)


def count(using: str, run_id: uuid.UUID) -> dict[str, int]:
    """Children of ``run_id`` per status, every status present, in one query."""
    counts = {status: 0 for status in RunStatus.values}
    for status, n in db.fetchall(
        using,
        _CHILDREN_BY_STATUS_SQL,
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
