"""Effect budgets on the root run: charged once per step, never overshot.

A charge locks the root's ``BudgetAccount`` row, so concurrent children
serialize on it. ``BudgetCharge`` is unique per (account, run, step, unit): a
retried, resumed or re-woken step finds its charge and pays nothing again.

What the limits are checked against is never a counter the runtime role can
rewrite (#35): raising ``effect_budget`` let three charges through a budget of
one, and five emails through a tree budget of three. The limits
(``effect_budget``, ``max_ai_calls``, ``max_steps``) are written with the root
and the runtime role holds no UPDATE privilege on them (``roles.py``); what
was spent is summed from the charges themselves (append-only: the runtime
role can neither change nor delete one), so a ``spent`` or ``ai_calls`` set
back to zero buys nothing. The counters stay on the account for display.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.db import connections

from .. import codes
from ..exceptions import InvalidInput
from . import db, seals

AI_CALLS = "ai_calls"


class BudgetExceeded(Exception):
    """A charge the tree's limits refuse, before anything is charged or dispatched; ``code``:
    what the step fails with (the steps of a tree are ``MAX_STEPS_EXCEEDED``)."""

    code = codes.EFFECT_BUDGET_EXCEEDED

    def __init__(
        self, unit: str, limit: int, spent: int, amount: int, code: str | None = None
    ) -> None:
        super().__init__(f"budget for {unit!r} is {limit}: {spent} spent, {amount} more asked")
        self.unit = unit
        if code is not None:
            self.code = code


class LimitsChanged(BudgetExceeded):
    """The root's limits do not match their seal (``seals.limits_problem``): someone
    who could (the table's owner) changed them after the run started. Refused as a
    budget is, before anything is charged or dispatched, saying why (#47)."""

    code = codes.INTEGRITY_CHAIN_BROKEN

    def __init__(self, problem: str) -> None:
        Exception.__init__(self, problem)
        self.unit = "limits"


class CostRefused(Exception):
    """An action's ``cost()`` found that this step cannot be priced, for a reason that
    running it again will not change (a django.tasks task's ``cost=`` raised or
    returned a unit its budget does not name): the step fails with ``code``
    before anything is charged or dispatched, where any other exception from
    ``cost()`` is retried."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def validate_cost(cost: Any) -> dict[str, int]:
    if cost is None:
        return {}
    if not isinstance(cost, dict) or not all(
        # The charges' columns: unit varchar(100), amount integer.
        isinstance(k, str)
        and 0 < len(k) <= 100
        and "\x00" not in k
        and isinstance(v, int)
        and not isinstance(v, bool)
        and 0 <= v <= 2**31 - 1
        for k, v in cost.items()
    ):
        raise InvalidInput(
            f"cost() must return a dict of unit (1-100 characters) -> int from 0 to 2**31-1, "
            f"not {cost!r:.200}"
        )
    return {k: v for k, v in cost.items() if v}


#: Whether this step was charged already, and (with a budget) what the tree spent:
#: the charges' sum, read after the account's lock was granted, so in a snapshot
#: that holds every charge committed before it (a sum in the locking statement
#: itself is read in that statement's older snapshot, and two workers overshot).
#: The statement the charge made anyway: no round trip more, its cost the tree's
#: charges read through their unique index.
_CHARGED_SQL = """
SELECT EXISTS (SELECT 1 FROM k2b_budget_charge
                WHERE account_id = %s AND run_id = %s AND seq = %s AND unit <> %s),
       CASE WHEN %s THEN
           (SELECT COALESCE(jsonb_object_agg(c.unit, c.total), '{}'::jsonb)
              FROM (SELECT unit, sum(amount) AS total FROM k2b_budget_charge
                     WHERE account_id = %s AND unit <> %s GROUP BY unit) c)
       END
"""


#: The root's account, locked: every charge of the tree serializes here.
#: With the three limits and their seal (``_sealed``): the limits a charge checks against
#: are the ones the run started with.
_LIMITS = "effect_budget, max_ai_calls, max_steps, limits_seal"
_LOCK_ACCOUNT_BUDGET_SQL = (
    f"SELECT {_LIMITS}, spent FROM k2b_budget_account WHERE root_id = %s FOR UPDATE"
)

_INSERT_CHARGE_SQL = (
    "INSERT INTO k2b_budget_charge (account_id, run_id, seq, unit, amount, created_at)"
    " VALUES (%s, %s, %s, %s, %s, k2b_now())"
)

#: What the tree spent, kept on the account for display (never checked against).
_SET_SPENT_SQL = "UPDATE k2b_budget_account SET spent = %s WHERE root_id = %s"


def charge(
    using: str, *, root_id: uuid.UUID, run_id: uuid.UUID, seq: int, cost: dict[str, int]
) -> bool:
    """Charge ``cost`` for one step, inside the caller's transaction.

    Returns False when this step was already charged (nothing is paid twice).
    Raises ``BudgetExceeded`` before writing anything when a unit would go over.
    """
    if not cost:
        return True
    with connections[using].cursor() as cursor:
        row = _locked_account(cursor, _LOCK_ACCOUNT_BUDGET_SQL, root_id)
        if row is None:
            return True
        budget, spent = _json(row[0]), _json(row[4])
        cursor.execute(
            _CHARGED_SQL, [root_id, run_id, seq, AI_CALLS, bool(budget), root_id, AI_CALLS]
        )
        already, summed = cursor.fetchone()
        if already:
            return False
        if summed is not None:
            spent = _json(summed)
        for unit, amount in cost.items():
            if unit in budget and spent.get(unit, 0) + amount > budget[unit]:
                raise BudgetExceeded(unit, budget[unit], spent.get(unit, 0), amount)
        for unit, amount in cost.items():
            spent[unit] = spent.get(unit, 0) + amount
            cursor.execute(
                _INSERT_CHARGE_SQL,
                [root_id, run_id, seq, unit, amount],
            )
        cursor.execute(
            _SET_SPENT_SQL,
            [json.dumps(spent), root_id],
        )
    return True


_LOCK_ACCOUNT_AI_CALLS_SQL = (
    f"SELECT {_LIMITS}, ai_calls FROM k2b_budget_account WHERE root_id = %s FOR UPDATE"
)

#: The AI calls charged to the tree, counted from the charges (see _CHARGED_SQL).
_AI_CALLS_CHARGED_SQL = "SELECT count(*) FROM k2b_budget_charge WHERE account_id = %s AND unit = %s"

_INSERT_AI_CALL_CHARGE_SQL = (
    "INSERT INTO k2b_budget_charge (account_id, run_id, seq, unit, amount, created_at)"
    " VALUES (%s, %s, %s, %s, 1, k2b_now()) ON CONFLICT DO NOTHING"
)

_COUNT_AI_CALL_SQL = "UPDATE k2b_budget_account SET ai_calls = ai_calls + 1 WHERE root_id = %s"


def charge_ai_call(using: str, *, root_id: uuid.UUID, run_id: uuid.UUID, seq: int) -> None:
    """One ``max_ai_calls`` unit for the AI task this step creates (called once, at creation)."""
    with connections[using].cursor() as cursor:
        row = _locked_account(cursor, _LOCK_ACCOUNT_AI_CALLS_SQL, root_id)
        if row is None:
            return
        limit, used = row[1], row[4]
        if limit is not None:
            # Counted from the charges, after the lock (see _CHARGED_SQL): ai_calls
            # set back to zero buys no call. Only with a limit: one statement more.
            cursor.execute(
                _AI_CALLS_CHARGED_SQL,
                [root_id, AI_CALLS],
            )
            used = cursor.fetchone()[0]
        if limit is not None and used + 1 > limit:
            raise BudgetExceeded(AI_CALLS, limit, used, 1)
        cursor.execute(
            _INSERT_AI_CALL_CHARGE_SQL,
            [root_id, run_id, seq, AI_CALLS],
        )
        if cursor.rowcount:
            cursor.execute(
                _COUNT_AI_CALL_SQL,
                [root_id],
            )


_LOCK_ACCOUNT_STEPS_SQL = (
    f"SELECT {_LIMITS}, children FROM k2b_budget_account WHERE root_id = %s FOR UPDATE"
)

_COUNT_CHILDREN_SQL = "UPDATE k2b_budget_account SET children = children + %s WHERE root_id = %s"


def reserve_children(using: str, *, root_id: uuid.UUID, count: int) -> None:
    """Count ``count`` new child runs against the root's ``max_steps``."""
    if not count:
        return
    with connections[using].cursor() as cursor:
        row = _locked_account(cursor, _LOCK_ACCOUNT_STEPS_SQL, root_id)
        if row is None:
            return
        limit, used = row[2], row[4]
        if limit is not None and used + count > limit:
            raise BudgetExceeded("steps", limit, used, count, codes.MAX_STEPS_EXCEEDED)
        cursor.execute(
            _COUNT_CHILDREN_SQL,
            [count, root_id],
        )


def _locked_account(cursor: Any, lock_sql: str, root_id: uuid.UUID) -> tuple | None:
    """The root's account row read by ``lock_sql`` (``_LIMITS`` first, then the counter
    the caller charges), locked: every charge of the tree serializes here. Its limits
    are checked against their seal before anything is charged; None: the tree has no
    account."""
    cursor.execute(lock_sql, [root_id])
    row = cursor.fetchone()
    if row is not None:
        _sealed(root_id, row)
    return row


def _sealed(root_id: uuid.UUID, row: tuple) -> None:
    """Raise ``LimitsChanged`` unless the account's limits (``_LIMITS``) match their seal."""
    problem = seals.limits_problem(root_id, _json(row[0]), row[1], row[2], row[3])
    if problem is not None:
        raise LimitsChanged(problem)


def _json(value: Any) -> dict:
    return dict(db.from_json(value) or {})
