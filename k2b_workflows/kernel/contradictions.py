"""A late result that contradicts what the run was told: an incident, never a silent end.

The failure this is built around (#47): a takeover asked ``reconcile()`` while
the holder was still inside the call (a holder taken for gone: a frozen
process whose presence could not be seen, a database without presence locks),
the provider said "absent", and the run ended FAILED; a moment later the
holder's call returned "succeeded". Its answer was kept as a ``late_result``
ledger entry, and nothing else: a caller saw FAILED for a charge that
happened. The same holds the other way round (reconciled "succeeded", the call
says it failed), and for an operator's resolution.

The late result is chained under the evidence key like every ledger entry, so
it is the provider's real answer. The other order is caught too: a takeover
that waited for the holder's answer (``effects.External.wait_for_holder``)
and then hears the opposite from ``reconcile()`` (a lookup lagging behind the
provider's writes) records that answer naming the late result
(``late_answer``) and hands the run to an operator with the same code.

When a late result contradicts the decision that closed its invocation (the
reconcile's answer, an operator's resolution, another holder's result), the
late entry names that decision (``detail.contradicts``), and:

- a run not ended yet goes to ``needs_attention`` with ``EFFECT_CONTRADICTED``,
  both entries in its ``error_detail``: it is in the operators' queue;
- a run already ended stays ended (``succeeded`` and ``canceled`` are final,
  DESIGN.md "Run lifecycle"), and ``verifyworkflows`` prints a
  ``CONTRADICTED`` line naming the run and both entries (``findings``); the
  run's page shows both entries in its ledger.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.db import connections

from .. import codes, redaction
from ..models import LedgerEntry
from ..validation import canonical_json
from . import db, ended

__all__ = [
    "FAILED",
    "SUCCEEDED",
    "contradicted",
    "decision_outcome",
    "findings",
    "late_answer",
    "raise_incident",
]

#: What closed an invocation, after its dispatch: the first of these answers it.
_DECISIONS_SQL = """
SELECT d.id, d.kind, d.detail FROM k2b_ledger d
 WHERE d.run_id = %s AND d.seq = %s AND d.kind = ANY(%s)
   AND d.id > (SELECT min(x.id) FROM k2b_ledger x
                WHERE x.run_id = %s AND x.seq = %s AND x.kind = 'dispatched'
                  AND x.invocation_key = %s)
 ORDER BY d.id LIMIT 1
"""

_DECIDING = [
    LedgerEntry.Kind.SUCCEEDED,
    LedgerEntry.Kind.FAILED,
    LedgerEntry.Kind.RECONCILED,
    LedgerEntry.Kind.RESOLVED_CONFIRMED,
    LedgerEntry.Kind.RESOLVED_ABSENT,
]

SUCCEEDED = "succeeded"
FAILED = "failed"


def decision_outcome(kind: str, detail: Any) -> str:
    """What a closing ledger entry says became of the effect: succeeded, or failed/absent."""
    if kind in (LedgerEntry.Kind.FAILED, LedgerEntry.Kind.RESOLVED_ABSENT):
        return FAILED
    if kind == LedgerEntry.Kind.RECONCILED and isinstance(detail, dict):
        return FAILED if detail.get("outcome") == FAILED else SUCCEEDED
    return SUCCEEDED


def contradicted(
    using: str, run_id: uuid.UUID, seq: int, invocation_key: str, outcome: str | None
) -> dict[str, Any] | None:
    """The decision that closed ``invocation_key`` and says the opposite of ``outcome``.

    ``outcome``: what the late call answered (None: it gave no answer, so it
    contradicts nothing). Called under the run's lock.
    """
    if outcome is None or not invocation_key:
        return None
    with connections[using].cursor() as cursor:
        cursor.execute(_DECISIONS_SQL, [run_id, seq, _DECIDING, run_id, seq, invocation_key])
        row = cursor.fetchone()
    if row is None:
        return None
    entry_id, kind, detail = row
    said = decision_outcome(kind, db.from_json(detail))
    if said == outcome:
        return None
    return {"entry": entry_id, "kind": kind, "outcome": said}


#: The last answer the call ``invocation_key`` gave its own worker, late: (entry, outcome).
_LATE_ANSWER_SQL = """
SELECT l.id, l.detail->>'outcome' FROM k2b_ledger l
 WHERE l.run_id = %s AND l.seq = %s AND l.kind = 'late_result' AND l.invocation_key = %s
   AND l.detail ? 'outcome'
 ORDER BY l.id DESC LIMIT 1
"""


def late_answer(
    using: str, run_id: uuid.UUID, seq: int, invocation_key: str, said: str
) -> dict[str, Any] | None:
    """The late result of ``invocation_key`` that says the opposite of ``said`` (what a
    reconcile just answered), as ``detail.contradicts`` names it; None if none does.

    The other order than ``contradicted``: the call answered its fenced-out worker
    first, and a lookup that lags behind the provider's own writes says otherwise.
    """
    with connections[using].cursor() as cursor:
        cursor.execute(_LATE_ANSWER_SQL, [run_id, seq, invocation_key])
        row = cursor.fetchone()
    if row is None or row[1] == said:
        return None
    return {"entry": row[0], "kind": LedgerEntry.Kind.LATE_RESULT, "outcome": row[1]}


_STATUS_SQL = "SELECT status, generation, workflow_name FROM k2b_run WHERE id = %s"

#: Each a legal step of the status FSM (``models.RUN_TRANSITIONS``), from where the
#: run is to ``needs_attention``: a queued run is taken (a new generation fences
#: whoever would claim it), a waiting one queued first.
_UNPARK_SQL = "UPDATE k2b_run SET status = 'queued', updated_at = k2b_now() WHERE id = %s"
_TAKE_SQL = """
UPDATE k2b_run SET status = 'running', generation = generation + 1, claimed_by = '',
       updated_at = k2b_now()
 WHERE id = %s RETURNING generation
"""
_ATTENTION_SQL = """
UPDATE k2b_run
   SET status = 'needs_attention', error_code = %s, error_message = %s, error_detail = %s,
       attention_step = %s, end_seal = %s, lease_expires_at = NULL, updated_at = k2b_now()
 WHERE id = %s
"""


def raise_incident(
    using: str, run_id: uuid.UUID, seq: int, late_id: int, decision: dict[str, Any]
) -> bool:
    """Put a run not ended yet in the operators' queue for a contradicted effect.

    In the caller's transaction, which holds the run's lock. Any holder of the
    run is fenced out by the status change. Returns False for a run already
    ended: it stays as it is, and ``findings`` reports it.
    """
    with connections[using].cursor() as cursor:
        cursor.execute(_STATUS_SQL, [run_id])
        status, generation, workflow_name = cursor.fetchone()
        if status in ("succeeded", "failed", "canceled"):
            return False
        if status == "waiting":
            cursor.execute(_UNPARK_SQL, [run_id])
            status = "queued"
        if status == "queued":
            cursor.execute(_TAKE_SQL, [run_id])
            generation = cursor.fetchone()[0]
        message = redaction.scrub_error(
            f"step {seq}: the late result (ledger entry {late_id}) contradicts the "
            f"{decision['kind']} entry {decision['entry']}, which said {decision['outcome']}"
        )
        code = codes.EFFECT_CONTRADICTED
        detail = {"kind": "contradiction", "seq": seq, "late_result": late_id, **decision}
        cursor.execute(
            _ATTENTION_SQL,
            [
                code,
                message,
                canonical_json(detail),
                seq,
                ended.seal(run_id, "needs_attention", code, generation),
                run_id,
            ],
        )
    ended.told(
        using,
        run_id=run_id,
        workflow_name=workflow_name,
        status="needs_attention",
        error_code=code,
        generation=generation,
        message=message,
        step=seq,
    )
    return True


_FINDINGS_SQL = """
SELECT l.run_id, r.workflow_name, r.status, l.seq, l.id, l.kind, l.detail
  FROM k2b_ledger l JOIN k2b_run r ON r.id = l.run_id
 WHERE l.kind IN ('late_result', 'reconcile_unknown') AND l.detail ? 'contradicts'
   AND NOT EXISTS (SELECT 1 FROM k2b_ledger o
                    WHERE o.run_id = l.run_id AND o.seq = l.seq AND o.id > l.id
                      AND o.kind IN ('resolved_confirmed', 'resolved_absent'))
 ORDER BY l.run_id, l.id
"""


def findings(using: str) -> list[str]:
    """Contradicted effects no operator has resolved since: one line each, for
    ``verifyworkflows``."""
    lines = []
    with connections[using].cursor() as cursor:
        cursor.execute(_FINDINGS_SQL)
        rows = cursor.fetchall()
    for run_id, name, status, seq, entry_id, kind, raw in rows:
        detail = db.from_json(raw)
        said = detail["contradicts"]
        lines.append(
            f"{run_id} {name} ({status}): step {seq}: {kind} entry {entry_id} says "
            f"{detail.get('outcome')}, {said['kind']} entry {said['entry']} said {said['outcome']}"
        )
    return lines
