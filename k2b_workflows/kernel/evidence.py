"""Keyed evidence hashes, the append-only journal and ledger, their chains and anchors.

The failure this is built around: someone with write access to the database
(a leaked password, a careless migration, a superuser) edits, deletes or
truncates evidence and recomputes the hashes, so the run replays the edited
output or re-runs an effect that already happened, and the audit trail lies.

- Every hash is an HMAC-SHA256 under a key kept outside the database
  (``keys.evidence_keys()``): without the key nobody recomputes a chain, and
  nobody recovers a small input, principal or idempotency key by brute force.
- Each run's journal and ledger are chains:
  ``entry_hash = HMAC(key, prev_hash ‖ canonical(entry))``; the entry records
  its ``key_id`` so that rotated keys still verify.
- The run row carries a keyed anchor per chain over (run, entry count, head),
  written in the transaction of every entry: a deleted or truncated tail, or a
  wiped chain, no longer matches it.
- Chains are verified when a run is loaded, before any step runs, and again
  before a success commits: the run's end compares each entry's row version
  and the anchors with what its execution verified and wrote
  (``AS_WRITTEN_CHECK``), and reads the chains back to check them hash by hash
  when anything differs; ``manage.py verifyworkflows`` checks every run.

Runs written before keyed chains (entries with an empty ``key_id``, unkeyed
SHA-256) still verify; their anchors were written by migration 0007. An
unkeyed entry after a keyed one is a break: nobody downgrades a chain.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import connections, models

from ..models import JournalEntry, LedgerEntry
from . import attempts, clock, db, instances
from .chain_checks import (  # noqa: F401  (verifying is the chains' API too)
    ChainBreak,
    StoredEntry,
    verify_chains,
    verify_run,
)
from .chain_hashes import GENESIS, anchor, journal_hash, ledger_hash
from .db import lease_lost
from .hashing import (  # noqa: F401  (hash_value and friends are the chains' API too)
    canonical,
    hash_optional,
    hash_text,
    hash_value,
    hmac_hex,
    redacted_summary,
    same_input,
    sha256_hex,
    signing_key,
)

E = TypeVar("E", bound=JournalEntry | LedgerEntry)


def initial_anchors(run_id: uuid.UUID) -> dict[str, str]:
    """Anchors of a new run's empty chains: a run whose chains were wiped is not a new run."""
    key_id, key = signing_key()
    return {
        "journal_anchor": anchor(run_id, "journal", 0, GENESIS, key_id, key),
        "ledger_anchor": anchor(run_id, "ledger", 0, GENESIS, key_id, key),
    }


#: A chain's anchor on the run row; the journal's keeps the journal's length with it.
_SEAL_JOURNAL_SQL = "UPDATE k2b_run SET journal_anchor = %s, journal_length = %s WHERE id = %s"
_SEAL_CHAIN_SQL = "UPDATE k2b_run SET {chain}_anchor = %s WHERE id = %s"
#: The length of a run's journal, for the seal of an entry appended the slow way.
_JOURNAL_COUNT_SQL = "SELECT count(*) FROM k2b_journal WHERE run_id = %s"
#: The length and head of a run's ledger, for the next entry's link.
_LEDGER_LENGTH_AND_HEAD_SQL = """
SELECT count(*), (SELECT entry_hash FROM k2b_ledger WHERE run_id = %s ORDER BY id DESC LIMIT 1)
  FROM k2b_ledger WHERE run_id = %s"""


def _seal(using: str, run_id: uuid.UUID, chain: str, count: int, head: str) -> None:
    key_id, key = signing_key()
    sealed = anchor(run_id, chain, count, head, key_id, key)
    with connections[using].cursor() as cursor:
        if chain == "journal":  # the run row keeps the journal's length with its anchor
            cursor.execute(_SEAL_JOURNAL_SQL, [sealed, count, run_id])
        else:
            cursor.execute(_SEAL_CHAIN_SQL.format(chain=chain), [sealed, run_id])


_JOURNAL_COLUMNS = """run_id, seq, action_name, effect, state, output, summary, error_code,
                         error_message, input_hash, generation, started_at, created_at,
                         key_id, prev_hash, entry_hash"""
_JOURNAL_VALUES = "id, %s, %s, %s, %s, %s::jsonb, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s"


def _journal_values(entry: JournalEntry) -> list[Any]:
    """Parameters for ``_JOURNAL_VALUES``, the run id coming from the row the CTE locked."""
    return [
        entry.seq,
        entry.action_name,
        entry.effect,
        entry.state,
        None if entry.output is None else canonical(entry.output),
        entry.summary,
        entry.error_code,
        entry.error_message,
        entry.input_hash,
        entry.generation,
        entry.started_at,
        entry.created_at,
        entry.key_id,
        entry.prev_hash,
        entry.entry_hash,
    ]


def inserted(entry: E, using: str, pk: Any) -> E:
    """``entry`` as Django's ``save()`` would leave it, after a raw INSERT returned ``pk``."""
    entry.pk = pk
    entry._state.adding = False
    entry._state.db = using
    return entry


def stored(entry: E, using: str, row: Sequence[Any]) -> E:
    """``inserted``, from an append's returned row (id, xmin): the entry also keeps its
    row version, for a later proof that it is stored as written."""
    inserted(entry, using, row[0])
    keep_row_version(entry, row[1] if len(row) > 1 else None)
    return entry


def stored_all(entries: Sequence[JournalEntry], using: str, row: Sequence[Any]) -> None:
    """``stored`` for the journal entries of one append (``journal_statement``), from its
    returned row: (id, xmin) for one entry, (ids in chain order, xmin) for several."""
    if len(entries) == 1:
        stored(entries[0], using, row)
        return
    for entry, pk in zip(entries, str(row[0]).split(","), strict=True):
        stored(entry, using, (int(pk), row[1]))


def written_row(row: Sequence[Any] | None) -> Sequence[Any] | None:
    """An append's returned row, or None when it wrote nothing (an append of several
    entries always returns one row: NULLs when nothing was inserted)."""
    return None if row is None or row[0] is None else row


def keep_row_version(entry: Any, xmin: str | None) -> None:
    """Note the entry's row version, ``"id:xmin"`` (None: not known)."""
    entry.row_version = None if xmin is None else f"{entry.pk}:{xmin}"


def row_version(entry: Any) -> str | None:
    """The row version ``stored`` kept, or None (an entry read, or saved by the ORM)."""
    return getattr(entry, "row_version", None)


def _chain_journal(entry: JournalEntry, prev_hash: str) -> tuple[str, bytes]:
    key_id, key = signing_key()
    entry.key_id = key_id
    entry.prev_hash = prev_hash
    entry.entry_hash = journal_hash(prev_hash, entry, key)
    return key_id, key


def _chain_journals(entries: Sequence[JournalEntry], prev_hash: str) -> tuple[str, bytes]:
    """Chain ``entries`` in order after ``prev_hash``."""
    key_id, key = signing_key()
    for entry in entries:
        key_id, key = _chain_journal(entry, prev_hash)
        prev_hash = entry.entry_hash
    return key_id, key


def _many(entries: JournalEntry | Sequence[JournalEntry]) -> list[JournalEntry]:
    return [entries] if isinstance(entries, JournalEntry) else list(entries)


def append_journal(entry: JournalEntry, prev_hash: str, using: str) -> JournalEntry:
    """Insert a journal entry chained to ``prev_hash`` and re-seal the run's anchor.

    Caller holds the run row lock, so no other entry of this run commits meanwhile.
    Steps are journaled in order, so the journal holds ``seq`` entries before this
    one and the anchor is sealed over ``seq + 1``: seal and insert are one statement
    that matches only if the run row's ``journal_length`` is ``seq`` (and sets it to
    ``seq + 1``). Otherwise (never, unless the journal has a gap) the entries are
    counted and the entry written in three statements, as before.
    """
    with db.statement_cursor(using) as cursor:
        cursor.execute(*journal_statement(entry, prev_hash, strict=False))
        row = cursor.fetchone()
        if row is not None:
            return stored(entry, using, row)
        cursor.execute(_JOURNAL_COUNT_SQL, [entry.run_id])
        count = cursor.fetchone()[0]
    entry.save(using=using, force_insert=True)
    _seal(using, entry.run_id, "journal", count + 1, entry.entry_hash)
    return entry


def append_journals(entries: Sequence[JournalEntry], prev_hash: str, using: str) -> str:
    """Insert ``entries`` in order, chained after ``prev_hash``, and re-seal the anchor, in
    one statement; returns the last entry's hash.

    For entries written all at once (a fork's copied steps, ``forks.py``): a
    thousand entries in one round trip, where ``append_journal`` takes one each.
    The journal must hold exactly the entries before the first: otherwise
    nothing is inserted and this raises.
    """
    with db.statement_cursor(using) as cursor:
        cursor.execute(*journal_statement(entries, prev_hash, strict=False))
        row = cursor.fetchone()
    written = written_row(row)
    if written is None:
        raise AssertionError(
            f"run {entries[0].run_id}: the journal does not end before step {entries[0].seq}"
        )
    stored_all(entries, using, written)
    return entries[-1].entry_hash


def append_journal_fenced(
    entry: JournalEntry | Sequence[JournalEntry],
    prev_hash: str,
    using: str,
    *,
    lease_ms: int = 0,
    reset: attempts.Reset | None = None,
) -> JournalEntry:
    """Fence the run, insert the entry (or several, in order) and re-seal the anchor in
    one statement; returns the last entry.

    The UPDATE in the statement takes the run row lock and checks the
    generation (re-checked on the newest row version if a takeover committed
    meanwhile), and the INSERT reads its row from that UPDATE: a fenced-out
    worker inserts nothing. The anchor is sealed over ``seq + 1`` entries, and
    the UPDATE matches only if the run row's ``journal_length`` is ``seq`` (a
    stale or repeated append inserts nothing), and sets it to ``seq + 1``. In
    autocommit this is one round trip and one commit, where fence + count +
    insert + seal in a transaction are six.

    The lease is extended by ``lease_ms``. Raises ``LeaseLost`` or ``RunCanceled``
    when the run is no longer ours. (A run's last step, journaled with its end,
    goes through ``fenced_journal_statement(run_output=..., end_seal=...)``.)
    """
    entries = _many(entry)
    sql, params = fenced_journal_statement(entries, prev_hash, lease_ms=lease_ms, reset=reset)
    with db.statement_cursor(using) as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    return fenced_journal_written(entries, using, row)


def fenced_journal_statement(
    entry: JournalEntry | Sequence[JournalEntry],
    prev_hash: str,
    *,
    lease_ms: int = 0,
    reset: attempts.Reset | None = None,
    run_output: str | None = None,
    end_seal: str = "",
    strict: bool = False,
    as_written: WrittenChains | None = None,
) -> tuple[str, list[Any]]:
    """Chain ``entry`` (or several entries, in order) and return the statement of
    ``append_journal_fenced`` and its parameters; ``strict``: one that fails instead
    of matching nothing, for a batch.

    ``as_written`` (with ``run_output``, strict): the run's end also checks that its
    chains are stored as that execution wrote them (``AS_WRITTEN_CHECK``; the
    statement's own entries are not in its snapshot: what is compared is what
    was stored before).
    ``end_seal`` (with ``run_output``): the run's end seal (``kernel/seals.py``).
    ``reset``: the reset of the run's failures that the step's completion carries
    (``attempts.py``); a run's end needs none (a success may lower the count).
    """
    entries = _many(entry)
    first, last = entries[0], entries[-1]
    if run_output is None:
        fence = Fence(last.generation, lease_ms, last.seq, reset=reset)
        return journal_statement(entries, prev_hash, fence, strict=strict)
    key_id, key = _chain_journals(entries, prev_hash)
    sealed = anchor(last.run_id, "journal", last.seq + 1, last.entry_hash, key_id, key)
    params = [run_output, end_seal, last.seq, sealed, last.seq + 1, last.run_id]
    params += [last.generation, first.seq]
    if as_written is not None:
        params += as_written.params()
    sql = _finish_sql(strict=strict, as_written=as_written is not None, rows=len(entries))
    return sql, [*params, *(v for e in entries for v in _journal_values(e))]


def journal_statement(
    entry: JournalEntry | Sequence[JournalEntry],
    prev_hash: str,
    fence: Fence | None = None,
    *,
    strict: bool = True,
) -> tuple[str, list[Any]]:
    """An append of ``entry`` (or several entries, in order) chained to ``prev_hash``,
    strict (for ``db.commit_batch``) unless ``strict`` is False; with ``fence``, the
    statement fences the run too."""
    entries = _many(entry)
    first, last = entries[0], entries[-1]
    key_id, key = _chain_journals(entries, prev_hash)
    sealed = anchor(last.run_id, "journal", last.seq + 1, last.entry_hash, key_id, key)
    fence_set, fence_where = _fenced(fence)
    params = [sealed, last.seq + 1, *fence_set, last.run_id, *fence_where, first.seq]
    sql = _append_sql("journal", strict=strict, fenced=fence is not None, rows=len(entries))
    return sql, [*params, *(v for e in entries for v in _journal_values(e))]


def fenced_journal_written(
    entry: JournalEntry | Sequence[JournalEntry], using: str, row: Sequence[Any] | None
) -> JournalEntry:
    """The entry (or entries) as inserted by that statement's returned ``row``; returns
    the last. No row: not ours any more."""
    entries = _many(entry)
    written = written_row(row)
    if written is None:
        raise lease_lost(using, entries[-1].run_id, entries[-1].generation)
    stored_all(entries, using, written)
    return entries[-1]


@functools.cache
def _ledger_fields() -> tuple[list[Any], str, str]:
    """The ledger fields an append inserts (``run`` excepted: the run id comes from the
    row the statement sealed), and the statement's column and value lists. Each field
    comes with whether its value goes to psycopg as is: for text, numbers and times
    Django's preparation returns the kernel's value unchanged, a cost per field.
    """
    fields = [f for f in LedgerEntry._meta.concrete_fields if not f.primary_key]
    columns = ", ".join(f.column for f in fields)
    values = ", ".join("id" if f.attname == "run_id" else "%s" for f in fields)
    plain = (
        models.CharField,
        models.TextField,
        models.IntegerField,
        models.BigIntegerField,
        models.DateTimeField,
    )
    inserted = [(f, type(f) in plain) for f in fields]
    return [(f, is_plain) for f, is_plain in inserted if f.attname != "run_id"], columns, values


_LEDGER_HEAD_CHECK = """(SELECT count(*) FROM k2b_ledger WHERE run_id = %s) = %s
       AND (SELECT entry_hash FROM k2b_ledger WHERE run_id = %s ORDER BY id DESC LIMIT 1)
           IS NOT DISTINCT FROM %s"""
#: The journal's length as the run row keeps it (``WorkflowRun.journal_length``), set by
#: the same statement (``_JOURNAL_LENGTH_SET``): read on the row the UPDATE locks, so a
#: takeover's append committed meanwhile is seen, where a count would not see it.
_JOURNAL_LENGTH_CHECK = "journal_length = %s"
_JOURNAL_LENGTH_SET = ", journal_length = %s"

_APPEND_SQL = """
WITH sealed AS (
    UPDATE k2b_run SET {chain}_anchor = %s{length_set}{fence_set}
     WHERE id = %s{fence_where}
       AND {check}
    RETURNING id){insert}
"""
#: The INSERT of one entry, reading the run id from ``sealed``...
_INSERT_ONE = """
INSERT INTO k2b_{chain} ({columns})
SELECT {values} FROM {source}
RETURNING id, xmin::text"""
#: ...or of several (a run's PURE successes riding on one write, ``journal.Pending``), in
#: chain order, returned as one row: their ids in order, and the transaction's ``xmin``.
_INSERT_MANY = """,
written AS (
INSERT INTO k2b_{chain} ({columns})
{selects}
RETURNING id, seq, xmin)
SELECT string_agg(id::text, ',' ORDER BY seq), min(xmin::text) FROM written"""


def _insert(chain: str, columns: str, values: str, source: str, rows: int = 1) -> str:
    """The INSERT part of an append of ``rows`` entries of ``chain`` (``_INSERT_ONE``/``_MANY``)."""
    if rows == 1:
        return _INSERT_ONE.format(chain=chain, columns=columns, values=values, source=source)
    selects = "\nUNION ALL\n".join([f"SELECT {values} FROM {source}"] * rows)
    return _INSERT_MANY.format(chain=chain, columns=columns, selects=selects)


#: Without its row the INSERT reads no row from ``sealed`` and inserts nothing...
_LENIENT = "sealed"
#: ...or, strict, one row whose run id is NULL: the statement fails (``db.guard_failed``).
_STRICT = "(SELECT) AS one LEFT JOIN sealed ON true"
#: The run's fence, carried by the UPDATE of a strict append (``Fence``).
_FENCE_SET = (
    """,
           lease_expires_at = k2b_now() + %s * interval '1 millisecond', updated_at = k2b_now(),
           current_step = COALESCE(%s, current_step),
           """
    + attempts.SET
)
_FENCE_WHERE = " AND generation = %s AND status = 'running'"


#: The last step's entry and the run's end in one statement, fenced as a step's append
#: is, the run marked succeeded with its output (``%s``, canonical JSON).
_FINISH_JOURNAL_TEMPLATE = """
WITH sealed AS (
    UPDATE k2b_run
       SET status = 'succeeded', output = %s::jsonb, end_seal = %s, error_code = '',
           error_message = '', finished_at = k2b_now(), lease_expires_at = NULL,
           current_step = %s, consecutive_failures = 0, journal_anchor = %s,
           journal_length = %s, updated_at = k2b_now()
     WHERE id = %s AND generation = %s AND status = 'running'
       AND journal_length = %s{verified}
    RETURNING id){insert}
"""

#: A run's chains as its execution wrote them: the run row's two anchors, and of each
#: chain its number of entries and the transactions that wrote them (each row's
#: ``xmin``). PostgreSQL gives every new row version the id of the transaction that
#: wrote it, and no other transaction can write one with that id: an entry edited,
#: or deleted and re-inserted, or added since, carries an id this execution never
#: saw (its claim's read, its own appends), and an entry deleted changes the count.
#: Equal, the stored entries are the ones this execution verified or hashed itself,
#: as they were written; this costs a test of each row's ``xmin`` against a short
#: list, where a list of every entry's ``id:xmin`` built, sorted and compared as text
#: cost a string per row on both sides. Parameters: ``WrittenChains.params()``.
AS_WRITTEN_CHECK = """
       AND journal_anchor = %s AND ledger_anchor = %s
       AND (SELECT count(*) = %s AND bool_and(j.xmin = ANY(%s::xid[])) IS NOT FALSE
              FROM k2b_journal j WHERE j.run_id = %s)
       AND (SELECT count(*) = %s AND bool_and(l.xmin = ANY(%s::xid[])) IS NOT FALSE
              FROM k2b_ledger l WHERE l.run_id = %s)"""


@functools.cache
def _finish_sql(*, strict: bool = False, as_written: bool = False, rows: int = 1) -> str:
    """The run's end with its last ``rows`` journal entries (``_FINISH_JOURNAL_TEMPLATE``)."""
    source = _STRICT if strict or as_written else _LENIENT
    return _FINISH_JOURNAL_TEMPLATE.format(
        verified=AS_WRITTEN_CHECK if as_written else "",
        insert=_insert("journal", _JOURNAL_COLUMNS, _JOURNAL_VALUES, source, rows),
    )


@functools.cache
def _append_sql(chain: str, *, strict: bool = False, fenced: bool = False, rows: int = 1) -> str:
    """The one-statement append to ``chain`` ("journal" or "ledger") that seals its anchor;
    ``rows`` journal entries at once (their count is checked before the first)."""
    length_set = ""
    if chain == "journal":
        check, columns, values = _JOURNAL_LENGTH_CHECK, _JOURNAL_COLUMNS, _JOURNAL_VALUES
        length_set = _JOURNAL_LENGTH_SET
    else:
        check = _LEDGER_HEAD_CHECK
        _, columns, values = _ledger_fields()
    return _APPEND_SQL.format(
        chain=chain,
        length_set=length_set,
        fence_set=_FENCE_SET if fenced else "",
        fence_where=_FENCE_WHERE if fenced else "",
        check=check,
        insert=_insert(chain, columns, values, _STRICT if strict else _LENIENT, rows),
    )


@dataclass(frozen=True)
class Fence:
    """What ``db.fence`` checks and sets, for the first statement of a batch to carry."""

    generation: int
    lease_ms: int
    step: int | None = None
    #: The reset of the run's failures the write carries (``attempts.py``), if any.
    reset: attempts.Reset | None = None

    def split(self) -> tuple[list[Any], list[Any]]:
        """Parameters of ``_FENCE_SET`` and of ``_FENCE_WHERE``."""
        return [self.lease_ms, self.step, *attempts.params(self.reset)], [self.generation]


def _fenced(fence: Fence | None) -> tuple[list[Any], list[Any]]:
    return fence.split() if fence is not None else ([], [])


@dataclass
class LedgerHead:
    """Where a run's ledger chain ends, as its executor last saw it: a hint, checked by
    the append itself, so a stale one costs a round trip and never a wrong chain."""

    count: int
    head: str | None
    #: The row versions (``stored``) of every entry of the chain, in order, while all
    #: are known: those read at the claim, then one from each append's returned row.
    versions: list[str] | None = None

    @classmethod
    def of(cls, entries: Sequence[LedgerEntry]) -> LedgerHead:
        return cls(len(entries), entries[-1].entry_hash if entries else None)

    @classmethod
    def loaded(cls, entries: Sequence[LedgerEntry]) -> LedgerHead:
        """The head of a chain as read, with its entries' row versions if all are known."""
        head = cls.of(entries)
        versions = [row_version(entry) for entry in entries]
        head.versions = None if None in versions else [v for v in versions if v]
        return head

    def appended(self, entry: LedgerEntry) -> None:
        """``entry``, stored after this head, is its new end."""
        self.count, self.head = self.count + 1, entry.entry_hash
        version = row_version(entry)
        if self.versions is not None and version is not None:
            self.versions.append(version)
        else:
            self.versions = None


@dataclass(frozen=True)
class WrittenChains:
    """What a run's end checks in ``AS_WRITTEN_CHECK``: the chains as one execution
    verified and wrote them (see ``Execution._written_chains``)."""

    run_id: uuid.UUID
    journal_anchor: str
    journal_versions: list[str]
    ledger_anchor: str
    ledger_versions: list[str]

    def params(self) -> list[Any]:
        return [
            self.journal_anchor,
            self.ledger_anchor,
            len(self.journal_versions),
            _writers(self.journal_versions),
            self.run_id,
            len(self.ledger_versions),
            _writers(self.ledger_versions),
            self.run_id,
        ]


def _writers(versions: list[str]) -> str | None:
    """The transactions that wrote the entries of ``versions`` (``"id:xmin"``), each once,
    as an array's text (a list would cost psycopg a dump of each element); None: none."""
    if not versions:
        return None
    return "{" + ",".join(dict.fromkeys(v[v.index(":") + 1 :] for v in versions)) + "}"


def current_anchor(
    run_id: uuid.UUID, chain: str, count: int, head: str | None, loaded: tuple[int, str]
) -> str:
    """The anchor a run row holds over ``chain`` for an execution that loaded ``loaded``
    (entry count, anchor) and has seen the chain reach ``count`` entries ending at
    ``head``: the loaded one if nothing was appended, else the one its last append
    sealed with the signing key (a key rotated since the claim leaves the first)."""
    loaded_count, loaded_anchor = loaded
    if count == loaded_count:
        return loaded_anchor
    key_id, key = signing_key()
    return anchor(run_id, chain, count, head or GENESIS, key_id, key)


def _ledger_entry(
    using: str, head: LedgerHead, fields: dict[str, Any]
) -> tuple[LedgerEntry, list[Any]]:
    """A new ledger entry chained after ``head``, and the parameters of its append
    (the fence's excepted): the anchor, the checks of ``head``, the values."""
    entry = instances.fresh(LedgerEntry, {"created_at": clock.now(), **fields})
    key_id, key = signing_key()
    entry.key_id = key_id
    entry.prev_hash = head.head or GENESIS
    entry.entry_hash = ledger_hash(entry.prev_hash, entry, key)
    sealed = anchor(entry.run_id, "ledger", head.count + 1, entry.entry_hash, key_id, key)
    connection = connections[using]
    values = [
        getattr(entry, f.attname)
        if plain
        else f.get_db_prep_save(getattr(entry, f.attname), connection)
        for f, plain in _ledger_fields()[0]
    ]
    run_id = entry.run_id
    return entry, [sealed, run_id, run_id, head.count, run_id, head.head, *values]


def ledger_statement(
    using: str, head: LedgerHead, fence: Fence | None = None, **fields: Any
) -> tuple[LedgerEntry, db.Statement]:
    """A strict append of a ledger entry after ``head`` for ``db.commit_batch``, and the
    entry. ``head`` moves past it: a copy of the run's, kept only once the batch commits."""
    entry, (sealed, run_id, *rest) = _ledger_entry(using, head, fields)
    fence_set, fence_where = _fenced(fence)
    params = [sealed, *fence_set, run_id, *fence_where, *rest]
    head.count, head.head = head.count + 1, entry.entry_hash
    return entry, (_append_sql("ledger", strict=True, fenced=fence is not None), params)


def append_ledger(using: str, *, expect: LedgerHead | None = None, **fields: Any) -> LedgerEntry:
    """Append a ledger entry to the run's chain and re-seal its anchor.

    Caller holds the run row lock. With ``expect`` (the chain's end as the caller
    believes it), chain, insert and seal are one statement that matches only if
    the ledger really ends there; ``expect`` is then moved past the new entry.
    Without it, or when it was stale, the end is read first (two more round trips).
    """
    if expect is not None:
        entry, params = _ledger_entry(using, expect, fields)
        with db.statement_cursor(using) as cursor:
            cursor.execute(_append_sql("ledger"), params)
            row = cursor.fetchone()
        if row is not None:
            stored(entry, using, row)
            expect.appended(entry)
            return entry
    entry = LedgerEntry(**{"created_at": clock.now(), **fields})
    key_id, key = signing_key()
    entry.key_id = key_id
    with connections[using].cursor() as cursor:
        cursor.execute(_LEDGER_LENGTH_AND_HEAD_SQL, [entry.run_id, entry.run_id])
        count, head = cursor.fetchone()
    entry.prev_hash = head or GENESIS
    entry.entry_hash = ledger_hash(entry.prev_hash, entry, key)
    entry.save(using=using, force_insert=True)
    _seal(using, entry.run_id, "ledger", count + 1, entry.entry_hash)
    if expect is not None:
        expect.count, expect.head = count + 1, entry.entry_hash
        expect.versions = None  # saved by the ORM: its row version is not known
    return entry
