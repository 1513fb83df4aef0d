"""What ``verifyworkflows`` says about flow-control and budget state that no kernel path writes.

The failure this is built around: the runtime role put three runs of a
limit-1 key inside the action, kept a key's slot on a finished run and set a
tree's spending back to zero, and ``verifyworkflows`` stayed silent (#35).
The privileges now refuse each of those writes (``roles.py``), but a role
granted more than ``grantworkflows`` grants, the owner, or a row written
before the upgrade can still leave such state behind. Each finding here is a
state the kernel never leaves, named with the runs or the root it concerns:

- a key with more slot holders than the least limit its holders started with;
- a run holding a slot without a key (the claim takes it as unkeyed);
- an ended run holding a slot with no live lease and no holder present (no
  action of it is inside ``run()``: the housekeeping frees it, unless nothing
  runs the housekeeping);
- a budget account whose ``spent`` or ``ai_calls`` is not the sum of its
  charges (a charge checks the sum, so this is a display lie or a tampering);
- a budget account whose limits do not match their seal (#47): the owner raised
  a budget after the run started (a charge refuses it too).

Reads only, in one statement per finding, each over an index or a table the
kernel keeps small (holders, accounts with charges).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from django.db import connections

from . import db, flow, seals

_OVER_LIMIT_SQL = """
SELECT workflow_name, concurrency_key, count(*), min(concurrency_limit),
       array_agg(id ORDER BY created_at)
  FROM k2b_run WHERE holds_slot AND concurrency_key IS NOT NULL
 GROUP BY 1, 2
HAVING count(*) > COALESCE(min(concurrency_limit), 0)
 ORDER BY 1, 2
"""

_KEYLESS_SQL = """
SELECT id, workflow_name, status FROM k2b_run
 WHERE holds_slot AND concurrency_key IS NULL ORDER BY id
"""

_ENDED_HOLDERS_SQL = f"""
SELECT id, workflow_name, status, concurrency_key FROM k2b_run
 WHERE holds_slot AND status IN ('succeeded', 'failed', 'canceled')
   AND (lease_expires_at IS NULL OR lease_expires_at <= k2b_now())
   AND {flow.HOLDER_GONE}
 ORDER BY id
"""

_SPENT_SQL = """
SELECT a.root_id, a.spent, COALESCE(c.units, '{}'::jsonb), a.ai_calls, COALESCE(c.ai, 0)
  FROM k2b_budget_account a
  LEFT JOIN (SELECT account_id,
                    jsonb_object_agg(unit, total) FILTER (WHERE unit <> 'ai_calls') AS units,
                    sum(total) FILTER (WHERE unit = 'ai_calls') AS ai
               FROM (SELECT account_id, unit, sum(amount) AS total FROM k2b_budget_charge
                      GROUP BY 1, 2) s
              GROUP BY account_id) c ON c.account_id = a.root_id
 WHERE a.spent::jsonb IS DISTINCT FROM COALESCE(c.units, '{}'::jsonb)
    OR a.ai_calls IS DISTINCT FROM COALESCE(c.ai, 0)
 ORDER BY a.root_id
"""


_LIMITS_SQL = """
SELECT root_id, effect_budget, max_ai_calls, max_steps, limits_seal
  FROM k2b_budget_account WHERE root_id > %s ORDER BY root_id LIMIT %s
"""


def _limits(cursor: Any, batch: int = 2000) -> Iterator[str]:
    """The accounts whose limits do not match their seal, read a page at a time."""
    after = uuid.UUID(int=0)
    while True:
        cursor.execute(_LIMITS_SQL, [after, batch])
        rows = cursor.fetchall()
        for root_id, budget, max_ai_calls, max_steps, sealed in rows:
            budget = db.from_json(budget) or {}
            problem = seals.limits_problem(root_id, budget, max_ai_calls, max_steps, sealed)
            if problem is not None:
                yield problem
        if len(rows) < batch:
            return
        after = rows[-1][0]


def findings(using: str) -> list[str]:
    """One line per tampered flow-control or budget state, in a stable order."""
    lines = []
    with connections[using].cursor() as cursor:
        cursor.execute(_OVER_LIMIT_SQL)
        for name, key, held, limit, ids in cursor.fetchall():
            lines.append(
                f"{name} key {key!r}: {held} runs hold a slot, its limit is {limit} "
                f"({', '.join(str(i) for i in ids)})"
            )
        cursor.execute(_KEYLESS_SQL)
        for run_id, name, status in cursor.fetchall():
            lines.append(f"{run_id} {name} ({status}): holds a slot without a concurrency key")
        cursor.execute(_ENDED_HOLDERS_SQL)
        for run_id, name, status, key in cursor.fetchall():
            lines.append(
                f"{run_id} {name} ({status}): ended, no action inside run(), "
                f"and still holds a slot of key {key!r}"
            )
        cursor.execute(_SPENT_SQL)
        for root_id, spent, summed, ai_calls, ai in cursor.fetchall():
            lines.append(
                f"budget of {root_id}: spent {spent} and {ai_calls} AI calls recorded, "
                f"but its charges sum to {summed} and {ai} AI calls"
            )
        lines.extend(_limits(cursor))
    return lines
