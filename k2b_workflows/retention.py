"""Retention: delete whole finished run trees, and wait rendezvous nobody can need.

Journal, ledger and budget charges are append-only by trigger and by
privilege; this is the one sanctioned way to remove them, run as the tables'
owner (``K2B_WORKFLOWS["OWNER_DATABASE"]``), and only together with their runs, once
every run of a tree has ended before the cutoff. Runs that need attention
are never purged.

Task batches (#50): a member of a batch whose callbacks have not been
enqueued yet is kept, whatever its age. The pass that enqueues them asks the
members whether one failed; a member purged before it would make a failed
batch look successful. A batch row goes once it has finished before the
cutoff and none of its members or callbacks' runs is left.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pgtrigger
from django.db import connections, transaction

from . import settings
from .kernel import batches, clock, witness

_APPEND_ONLY = (
    "k2b_workflows.JournalEntry:journal_append_only",
    "k2b_workflows.LedgerEntry:ledger_append_only",
    "k2b_workflows.BudgetCharge:charge_append_only",
)

#: A uuid's text: what is cast to uuid is matched first, so that a value that is not
#: one (the runtime role can write these rows) names nothing, rather than raising an
#: error that would stop every purge.
_UUID_TEXT = "'^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$'"
#: The batch of run ``d`` as a uuid, for a lookup by primary key (NULL: none).
_BATCH_OF_D = f"CASE WHEN d.input ->> 'batch' ~ {_UUID_TEXT} THEN (d.input ->> 'batch')::uuid END"

_ROOTS_SQL = f"""
SELECT r.id FROM k2b_run r
 WHERE r.parent_id IS NULL
   AND r.status IN ('succeeded', 'failed', 'canceled') AND r.finished_at < %s
   AND NOT EXISTS (SELECT 1 FROM k2b_run d
                    WHERE d.root_id = r.id
                      AND (d.status NOT IN ('succeeded', 'failed', 'canceled')
                           OR d.finished_at IS NULL OR d.finished_at >= %s
                           OR (d.input ? 'batch' AND EXISTS (
                                 SELECT 1 FROM k2b_task_batch b
                                  WHERE b.id = {_BATCH_OF_D} AND b.finished_at IS NULL))))
 ORDER BY r.finished_at
 LIMIT %s
"""

# Children before what they reference; the run rows last, all at once (their
# foreign keys to each other are checked at commit).
_DELETES = (
    ("budget charges", "DELETE FROM k2b_budget_charge WHERE run_id = ANY(%s)"),
    ("budget accounts", "DELETE FROM k2b_budget_account WHERE root_id = ANY(%s)"),
    ("AI tasks", "DELETE FROM k2b_ai_task WHERE run_id = ANY(%s)"),
    ("dedup records", "DELETE FROM k2b_dedup WHERE run_id = ANY(%s)"),
    ("task attempts", "DELETE FROM k2b_task_attempt WHERE run_id = ANY(%s)"),
    ("progress", "DELETE FROM k2b_progress WHERE run_id = ANY(%s)"),
    ("journal entries", "DELETE FROM k2b_journal WHERE run_id = ANY(%s)"),
    ("ledger entries", "DELETE FROM k2b_ledger WHERE run_id = ANY(%s)"),
    ("runs", "DELETE FROM k2b_run WHERE id = ANY(%s)"),
)

#: Batches finished before the cutoff with no member and no callback's run left, the
#: runs of this pass's trees (``%s``, deleted just before, or counted as gone by a dry
#: run) apart.
_BATCHES_SQL = f"""
DELETE FROM k2b_task_batch WHERE id IN (
SELECT b.id FROM k2b_task_batch b
 WHERE b.finished_at < %s
   AND NOT EXISTS (SELECT 1 FROM k2b_run
                    WHERE {batches.MEMBER_OF.format(batch="b.id::text")} AND id <> ALL(%s))
   AND NOT EXISTS (SELECT 1 FROM k2b_run cr
                    WHERE cr.id = ANY(ARRAY(
                            SELECT CASE WHEN c.value ~ {_UUID_TEXT} THEN c.value::uuid END
                              FROM jsonb_each_text(COALESCE(b.callback_runs, '{{}}'::jsonb)) c))
                      AND cr.id <> ALL(%s))
 ORDER BY b.finished_at
 LIMIT %s)
"""

_RENDEZVOUS_SQL = """
DELETE FROM k2b_wait w
 WHERE COALESCE(w.signaled_at, w.created_at) < %s
   AND NOT EXISTS (SELECT 1 FROM k2b_run r
                    WHERE r.status NOT IN ('succeeded', 'failed', 'canceled')
                      AND r.app_id = w.app_id AND r.wait_kind = w.kind AND r.wait_key = w.key)
"""

#: A dry run counts what each DELETE would delete: the same statement, its head replaced.
_COUNT_INSTEAD = ("DELETE FROM", "SELECT count(*) FROM")
_COUNT_RENDEZVOUS_INSTEAD = ("DELETE FROM k2b_wait w", "SELECT count(*) FROM k2b_wait w")


#: Every run of the trees of these roots.
_TREE_SQL = "SELECT id FROM k2b_run WHERE root_id = ANY(%s)"


def purge_finished_runs(
    *,
    older_than: dt.timedelta,
    batch: int = 1000,
    dry_run: bool = False,
    using: str | None = None,
) -> dict[str, int]:
    """Delete up to ``batch`` run trees whose every run ended more than ``older_than`` ago.

    Then up to ``batch`` task batches finished as long ago whose members and
    callbacks' runs are all gone (``"task batches"``). Also deletes wait rendezvous
    last touched before the cutoff that no unfinished run refers to. Caveat: a wake
    recorded before the cutoff for a run that has not yet reached the step waiting on
    it is forgotten. Returns counts per table.
    """
    if older_than <= dt.timedelta(0):
        raise ValueError("older_than must be positive")
    # The runtime role holds no DELETE on the append-only tables (roles.py): only
    # the owner purges, and pgtrigger.ignore is then the one sanctioned bypass.
    using = using or settings.owner_database()
    cutoff = clock.now() - older_than
    counts: dict[str, Any] = {}
    with (
        transaction.atomic(using=using),
        pgtrigger.ignore(*_APPEND_ONLY, databases=[using]),
        connections[using].cursor() as cursor,
    ):
        cursor.execute(_ROOTS_SQL, [cutoff, cutoff, batch])
        roots = [row[0] for row in cursor.fetchall()]
        cursor.execute(_TREE_SQL, [roots])
        tree = [row[0] for row in cursor.fetchall()]
        counts["run trees"] = len(roots)
        for label, sql in _DELETES:
            if dry_run:
                cursor.execute(sql.replace(*_COUNT_INSTEAD, 1), [tree])
                counts[label] = cursor.fetchone()[0]
            else:
                cursor.execute(sql, [tree])
                counts[label] = cursor.rowcount
        if not dry_run:
            # A purge is not a rollback: the witness is told, so that its older
            # records of these runs are not reported as missing.
            transaction.on_commit(lambda: witness.purged(tree), using=using)
        params: list[Any] = [cutoff, tree, tree, batch]
        if dry_run:
            cursor.execute(_BATCHES_SQL.replace(*_COUNT_INSTEAD, 1), params)
            counts["task batches"] = cursor.fetchone()[0]
        else:
            cursor.execute(_BATCHES_SQL, params)
            counts["task batches"] = cursor.rowcount
        sql = _RENDEZVOUS_SQL
        if dry_run:
            sql = sql.replace(*_COUNT_RENDEZVOUS_INSTEAD, 1)
            cursor.execute(sql, [cutoff])
            counts["wait rendezvous"] = cursor.fetchone()[0]
        else:
            cursor.execute(sql, [cutoff])
            counts["wait rendezvous"] = cursor.rowcount
    return counts
