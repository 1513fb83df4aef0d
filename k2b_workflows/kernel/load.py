"""The preload of a claimed run: its row, journal and ledger in one statement.

A claim reads what an execution needs to replay a run in the claim's own
transaction (``preload``), so a claim and its reads cost one commit. A run's
end reads the chains again to verify them (``chains_sql``), and
``verifyworkflows`` reads them the same way (``audit.py``).
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass
from typing import Any

from django.db.models import JSONField

from ..models import JournalEntry, LedgerEntry, WorkflowRun
from . import db, evidence, instances


@dataclass
class Preloaded:
    """What an execution needs to replay a run, read once."""

    run: WorkflowRun
    journal: list[JournalEntry]
    ledger: list[LedgerEntry]


_PRELOAD_SQL = """
SELECT {run_columns},
       (SELECT json_agg(j ORDER BY j.seq) FROM {journal} j WHERE j.run_id = r.id),
       (SELECT json_agg(l) FROM {ledger} l WHERE l.run_id = r.id)
  FROM k2b_run r
 WHERE {where}
"""
#: The ledger comes unordered and is put in its order (by ``id``) here: a claim's
#: preload is planned without sorts (``claim.CLAIM_PLAN``), and asked for its
#: entries by ``id``, PostgreSQL 16 and later walked the ledger's primary key to
#: give the aggregate its input in order, reading every entry of every run for
#: each claimed run: 84 ms a claim with 3,000 tasks' entries, and growing with the
#: table. Unordered, it reads the run's own entries through ``k2b_ledger_step``.
#: A run's journal is asked for by ``seq``, the order of its own index
#: (``k2b_journal_step_once``): no sort either.

#: A claim's entries come with their row versions (``row_xmin``): verified at load,
#: they are what the run's end checks its chains against (``ending.RunEnding``).
_VERSIONED = "(SELECT t.*, t.xmin::text AS row_xmin FROM {table} t)"


def preload(using: str, run_ids: list[uuid.UUID]) -> dict[uuid.UUID, Preloaded]:
    """Read claimed runs with their journals and whole ledgers: one raw statement.

    Called inside the claim's transaction, so a claim and its reads cost one commit.
    A statement of its own, after the claim's: under READ COMMITTED it takes a
    new snapshot, so it sees every journal entry committed before our claim
    locked the row (a claim's own snapshot may predate a holder's last commit).
    Raw SQL because compiling three ORM queries per claim cost the claiming
    thread more than the round trips did.
    """
    if not run_ids:
        return {}
    return preloaded(using, db.fetch_statement(using, *preload_statement(run_ids)))


def preload_statement(run_ids: list[uuid.UUID]) -> tuple[str, list[Any]]:
    """The statement of ``preload`` for these (one or more) run ids, and its parameters."""
    if len(run_ids) == 1:
        return preload_sql(single=True), list(run_ids)
    return preload_sql(), [list(run_ids)]


@functools.cache
def preload_sql(*, single: bool = False) -> str:
    """The statement of ``preload`` (built once); its one parameter is a list of run ids,
    or one run id with ``single``.

    Two statements, because a prepared ``id = ANY($1)`` is planned again at
    every execution (PostgreSQL prefers a plan for the array at hand to the
    generic one), and a run's end reads one run: ``id = $1`` is planned once.
    """
    run_fields = WorkflowRun._meta.concrete_fields
    return _PRELOAD_SQL.format(
        run_columns=", ".join(f"r.{f.column}" for f in run_fields),
        journal=_VERSIONED.format(table="k2b_journal"),
        ledger=_VERSIONED.format(table="k2b_ledger"),
        where="r.id = %s" if single else "r.id = ANY(%s)",
    )


@functools.cache
def _run_columns() -> tuple[list[str], list[int]]:
    """The run row's attnames in ``preload_sql``'s order, and which of them hold JSON."""
    fields = WorkflowRun._meta.concrete_fields
    return [f.attname for f in fields], [
        i for i, f in enumerate(fields) if isinstance(f, JSONField)
    ]


def preloaded(using: str, rows: list[tuple]) -> dict[uuid.UUID, Preloaded]:
    """Runs, journals and ledgers from the rows of ``preload_sql``."""
    attnames, json_columns = _run_columns()
    width = len(attnames)
    loaded: dict[uuid.UUID, Preloaded] = {}
    for row in rows:
        values = list(row[:width])
        for i in json_columns:
            values[i] = db.from_json(values[i])
        run = instances.loaded(WorkflowRun, using, attnames, values)
        loaded[run.pk] = _with_entries(using, run, row)
    return loaded


#: What a verification of a run's chains reads (``chains_sql``): the run's anchors.
_CHAINS_FIELDS = ["id", "journal_anchor", "ledger_anchor"]


@functools.cache
def chains_sql() -> str:
    """``preload_sql(single=True)`` for a verification of the chains: of the run row
    only its id and anchors, where a claim reads and decodes every column."""
    return _PRELOAD_SQL.format(
        run_columns=", ".join(f"r.{column}" for column in _CHAINS_FIELDS),
        journal="k2b_journal",
        ledger="k2b_ledger",
        where="r.id = %s",
    )


def chains_read(using: str, rows: list[tuple]) -> dict[uuid.UUID, Preloaded]:
    """Runs (id and anchors only), journals and ledgers from the rows of ``chains_sql``.

    The entries are ``evidence.StoredEntry`` objects, not model instances: they are
    only verified, never replayed, and building a model instance (each field
    through ``to_python``, timestamps parsed) costs many times what verifying
    an entry does (docs/performance.md).
    """
    loaded: dict[uuid.UUID, Preloaded] = {}
    for row in rows:
        run = WorkflowRun.from_db(using, _CHAINS_FIELDS, row[: len(_CHAINS_FIELDS)])
        journal = [evidence.StoredEntry(e) for e in db.from_json(row[-2]) or ()]
        ledger = [evidence.StoredEntry(e) for e in _ledger_rows(row[-1])]
        loaded[run.pk] = Preloaded(run, journal, ledger)  # type: ignore[arg-type]
    return loaded


def _with_entries(using: str, run: WorkflowRun, row: tuple) -> Preloaded:
    """The run with its journal and ledger, the row's last two columns."""
    journal = [_from_json_row(JournalEntry, using, e) for e in db.from_json(row[-2]) or ()]
    ledger = [_from_json_row(LedgerEntry, using, e) for e in _ledger_rows(row[-1])]
    return Preloaded(run, journal, ledger)


def _ledger_rows(value: Any) -> list[dict[str, Any]]:
    """A run's ledger entries (``json_agg`` output) in their order, by ``id``."""
    return sorted(db.from_json(value) or (), key=lambda entry: entry["id"])


@functools.cache
def _entry_columns(model: Any) -> tuple[list[str], list[tuple[str, Any]]]:
    """An entry model's attnames, and each field's column with what turns its
    ``row_to_json`` value into the field's (None: JSON, taken as it is)."""
    fields = model._meta.concrete_fields
    return [f.attname for f in fields], [
        (f.column, None if isinstance(f, JSONField) else f.to_python) for f in fields
    ]


def _from_json_row(model: Any, using: str, data: dict[str, Any]) -> Any:
    """A model instance from ``row_to_json`` output (timestamps and UUIDs arrive as text),
    with its row version (``evidence.row_version``) when the row carried it."""
    attnames, columns = _entry_columns(model)
    values = [data[c] if parse is None else parse(data[c]) for c, parse in columns]
    instance = instances.loaded(model, using, attnames, values)
    if "row_xmin" in data:
        evidence.keep_row_version(instance, data["row_xmin"])
    return instance
