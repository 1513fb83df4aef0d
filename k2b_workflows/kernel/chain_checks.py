"""Checking a run's journal and ledger chains and their anchors, entry by entry.

Apart from the writers (``evidence``): verifying reads stored rows and recomputes
their hashes with every known key (old ones too), where writing signs with the
current key only; an auditor's read-only role needs this module and nothing that writes.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connections, transaction

from ..models import JournalEntry, LedgerEntry, WorkflowRun
from .chain_hashes import GENESIS, anchor, journal_hash, ledger_hash
from .keys import evidence_keys


@dataclass(frozen=True)
class ChainBreak:
    """Where a run's evidence stops being trustworthy, and why."""

    chain: str  # "journal" or "ledger"
    position: int  # 1-based entry number in the chain; for an anchor, the entry count
    reason: str
    entry_id: int | None = None
    seq: int | None = None

    def __str__(self) -> str:
        if self.entry_id is None:  # the run row's anchor over the whole chain
            return f"{self.chain} anchor over {self.position} entries: {self.reason}"
        where = f"{self.chain} entry {self.position}"
        if self.entry_id is not None:
            where += f" (id {self.entry_id}" + (
                f", step {self.seq})" if self.seq is not None else ")"
            )
        return f"{where}: {self.reason}"


class StoredEntry:
    """A journal or ledger entry as ``row_to_json`` stored it, read by attribute: what
    ``verify_run`` reads (the chained fields, ``prev_hash``, ``entry_hash``,
    ``key_id``, ``pk``), without building a model instance.

    The chained fields are text, integers and JSON, which the model would hold
    unchanged; ``run_id`` arrives as text, and ``_entry_hash`` hashes its text
    either way. Not for replay: timestamps stay text.
    """

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)
        self.pk = values["id"]


def _verify_chain(
    run: WorkflowRun, chain: str, entries: Sequence[Any], keys: dict[str, bytes]
) -> ChainBreak | None:
    hasher = journal_hash if chain == "journal" else ledger_hash
    prev = GENESIS
    keyed = False
    for position, entry in enumerate(entries, start=1):

        def broken(reason: str, entry: Any = entry, position: int = position) -> ChainBreak:
            return ChainBreak(chain, position, reason, entry.pk, entry.seq)

        if entry.prev_hash != prev:
            return broken("prev_hash does not match the previous entry (an entry was removed)")
        if entry.key_id:
            key = keys.get(entry.key_id)
            if key is None:
                return broken(f"made with key id {entry.key_id!r}, which no evidence key has")
            keyed = True
        elif keyed:
            return broken("an unkeyed entry after keyed ones (a recomputed chain)")
        else:
            key = None
        if not hmac.compare_digest(hasher(prev, entry, key), entry.entry_hash):
            return broken("contents do not match entry_hash (the entry was edited)")
        prev = entry.entry_hash
    sealed = getattr(run, f"{chain}_anchor")
    key_id, _, _mac = sealed.partition(":")
    count = len(entries)
    if not sealed:
        return ChainBreak(chain, count, "the run has no anchor (it was wiped)")
    if key_id not in keys:
        return ChainBreak(chain, count, f"anchor made with key id {key_id!r}, which no key has")
    expected = anchor(run.pk, chain, count, prev, key_id, keys[key_id])
    if not hmac.compare_digest(expected, sealed):
        return ChainBreak(
            chain,
            count,
            "does not match (entries were removed, added or rewritten)",
        )
    return None


def verify_run(
    run: WorkflowRun, journal: Sequence[JournalEntry], ledger: Sequence[LedgerEntry]
) -> ChainBreak | None:
    """Check both chains of a run (journal by ``seq``, ledger by ``id``) and their anchors.

    Pure: the caller reads the rows (the claim's preload, a ``verifyworkflows`` batch).
    """
    keys = dict(evidence_keys())
    return _verify_chain(run, "journal", journal, keys) or _verify_chain(
        run, "ledger", ledger, keys
    )


def verify_chains(run_id: uuid.UUID, using: str) -> ChainBreak | None:
    """Re-read the run's row, journal and ledger from the database and check them.

    Returns the first break, or None when everything is intact. The reads share
    one snapshot (REPEATABLE READ, read only), so the row's anchor and the
    entries are read as of one moment, never an anchor from before an entry
    that committed between two of these reads (a false break on a live run),
    and without a lock: a read-only auditor role can run it. Inside a caller's
    transaction, its snapshot is used as it is.
    """
    connection = connections[using]
    outer = connection.in_atomic_block
    with transaction.atomic(using=using), connection.cursor() as cursor:
        if not outer:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        run = WorkflowRun.objects.using(using).get(pk=run_id)
        journal = list(JournalEntry.objects.using(using).filter(run_id=run_id).order_by("seq"))
        ledger = list(LedgerEntry.objects.using(using).filter(run_id=run_id).order_by("id"))
    return verify_run(run, journal, ledger)
