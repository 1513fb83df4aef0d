"""A run's evidence checked from what the database holds now: its chains, anchors and seals.

The failure this is built around: a check that reads the run row and its
entries in separate statements sees a live run between two commits and
reports a break that is not there, and a check that takes a lock to avoid
that cannot be run by a read-only auditor. One statement is one snapshot:
the run row (anchors, seals) and every entry come from the same moment,
without a lock (``load.preload`` is that statement).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from ..models import JournalEntry, LedgerEntry, WorkflowRun
from . import evidence, seals
from .load import preload


@dataclass(frozen=True)
class Problem:
    """What is wrong with a run's evidence; ``kind`` is "seal" (the row's own fields)
    or "chain" (the journal or the ledger, or their anchors)."""

    kind: str
    text: str

    def __str__(self) -> str:
        return self.text


def check(
    run: WorkflowRun, journal: Sequence[JournalEntry], ledger: Sequence[LedgerEntry]
) -> Problem | None:
    """The first problem of a run already read (a ``verifyworkflows`` batch), or None."""
    sealed = seals.problem(run)
    if sealed:
        return Problem("seal", sealed)
    broken = evidence.verify_run(run, journal, ledger)
    return Problem("chain", str(broken)) if broken else None


def stored_problem(run_id: uuid.UUID, using: str) -> Problem | None:
    """Read the run and its entries in one statement and check them; None when intact.

    A run that no longer exists is a problem too: its evidence is gone.
    """
    run_id = uuid.UUID(str(run_id))
    loaded = preload(using, [run_id]).get(run_id)
    if loaded is None:
        return Problem("chain", f"run {run_id} does not exist (deleted)")
    return check(loaded.run, loaded.journal, loaded.ledger)
