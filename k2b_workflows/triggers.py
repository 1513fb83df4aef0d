"""The database triggers that hold the run lifecycle and the evidence, whoever connects.

The failure this module is built around: a trigger is only as strong as the
names it resolves. A PL/pgSQL function resolves unqualified names through the
*caller's* ``search_path``, and a session's temporary schema comes first on it
unless it is named. So a runtime role could ``CREATE TEMP TABLE pg_class``,
make the owner-only ignore check read its own table, switch off the status and
generation rules with ``pgtrigger.ignore`` and reopen a succeeded run that had
charged a card. Every function created here therefore runs with a fixed
``search_path`` (``pg_catalog`` first, ``pg_temp`` last, so a temporary table
can never shadow a catalog) and names what it reads with its schema.

``PinnedTrigger`` compiles a django-pgtrigger trigger with that ``search_path``
on both functions pgtrigger creates (the trigger's own and
``_pgtrigger_should_ignore``); every trigger of the app derives from it, and
``tests/misuse/test_attacks.py`` fails for any function of the app without it.
"""

from __future__ import annotations

from typing import Any

import pgtrigger
import pgtrigger.compiler
import pgtrigger.utils

#: What every function of the app runs with: catalogs first, temporary objects last.
PINNED_SEARCH_PATH = "pg_catalog, pg_temp"

#: Raises unless the session's role may own the table: ``pgtrigger.ignore`` is a
#: session setting any role can set, so without this a runtime role could switch
#: off the status rules of the rows it updates. Created (and replaced) by the
#: migrations; kept here so that its text has one home.
OWNER_ONLY_IGNORE_SQL = f"""
CREATE OR REPLACE FUNCTION "public"._k2b_refuse_foreign_ignore(trigger_name NAME, tbl OID)
RETURNS BOOLEAN
LANGUAGE plpgsql STABLE
SET search_path = {PINNED_SEARCH_PATH}
AS $$
BEGIN
    IF trigger_name = ANY(
           NULLIF(pg_catalog.current_setting('pgtrigger.ignore', true), '')::text[])
       AND NOT pg_catalog.pg_has_role(
           current_user,
           (SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid = tbl),
           'MEMBER')
    THEN
        RAISE EXCEPTION 'k2b_workflows: only the owner of % may ignore %', tbl::regclass,
            trigger_name USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN TRUE;
END;
$$;
"""


class PinnedUpsertTriggerSql(pgtrigger.compiler.UpsertTriggerSql):
    """pgtrigger's installation SQL with a fixed ``search_path`` on both functions.

    Migrations reference this class by its path, as they reference pgtrigger's:
    its template must never change in a way older migrations would not expect.
    """

    def get_template(self) -> str:
        pinned = f"$$ LANGUAGE plpgsql SET search_path = {PINNED_SEARCH_PATH};"
        template = super().get_template()
        assert template.count("$$ LANGUAGE plpgsql;") == 2, "pgtrigger's template changed"
        return template.replace("$$ LANGUAGE plpgsql;", pinned)


class PinnedTrigger(pgtrigger.Trigger):
    """A trigger compiled with ``PinnedUpsertTriggerSql``: every app trigger derives from it."""

    def compile(self, model: Any) -> pgtrigger.compiler.Trigger:
        compiled = super().compile(model)
        return pgtrigger.compiler.Trigger(
            name=compiled.name, sql=PinnedUpsertTriggerSql(**compiled.sql.kwargs)
        )


class Notify(PinnedTrigger):
    """``pg_notify`` the workers' channel with the app id of a row that became runnable.

    A notification is only a wake-up: a rolled-back transaction never
    delivers one, and workers keep polling in case one is missed.
    """

    when = pgtrigger.After
    channel = "k2b_workflows"

    def __init__(self, *, channel: str = "k2b_workflows", **kwargs: Any) -> None:
        self.channel = channel
        super().__init__(**kwargs)

    def get_func(self, model: Any) -> str:
        return f"PERFORM pg_catalog.pg_notify('{self.channel}', NEW.app_id); RETURN NULL;"


#: The advisory lock a waiter on a run's result holds, shared, while it waits
#: (``results.py``); the run's end tries it exclusively (``NotifyEnded``). The
#: parameter is the run id as text.
WAITED_LOCK = "pg_catalog.hashtextextended('k2b.result:' || {run_id}, 0)"


class NotifyEnded(PinnedTrigger):
    """``pg_notify`` the id of a run that just ended (or needs an operator), when someone
    waits for it.

    In the trigger, not in the code that ends a run: every way a run ends (a
    worker's batched end, a cancel, an operator's decision, a hand-written
    ``UPDATE``) announces it, in the transaction that ends it and without a
    statement of its own. A rolled-back end announces nothing; a waiter that
    misses a notification (its connection was down) finds the end by polling
    (``results.py``).

    Only to a waiter: a NOTIFY makes every backend that LISTENs in the database
    (each worker's, on any channel) wake up and run a transaction to read the
    queue, and its commit takes the server's notify lock: one more commit and
    a backend's wake-up per run ended, for runs nobody waits on. A waiter holds
    ``WAITED_LOCK`` shared while it waits, from before its first read of the
    run; the end takes it exclusively, or notifies when it cannot. Both sides
    meet on the lock: a waiter that comes while the end holds it is refused it
    and reads the run again at its next poll (the end was not committed yet),
    one that came before is notified.

    The lock is tried in the trigger's ``WHEN`` clause, so the function (a
    PL/pgSQL call with pgtrigger's ignore check, and the after-trigger event that
    queues it) runs only for a run someone waits on, not for each of a drained
    backlog: with the trigger disabled, a no-op task cost the server about 60 µs
    less, of some 470.
    ``CASE`` makes the order certain: the lock is tried only for an update that
    ends the run.
    """

    when = pgtrigger.After
    channel = "k2b_run_ended"

    def get_condition(self, model: Any) -> pgtrigger.Condition:
        ends = self.condition.resolve(model) if self.condition else "TRUE"
        lock = WAITED_LOCK.format(run_id="NEW.id::text")
        return pgtrigger.Condition(
            f"CASE WHEN {ends} THEN NOT pg_catalog.pg_try_advisory_xact_lock({lock}) ELSE FALSE END"
        )

    def get_func(self, model: Any) -> str:
        return f"PERFORM pg_catalog.pg_notify('{self.channel}', NEW.id::text); RETURN NULL;"


class OwnerOnlyIgnore(PinnedTrigger):
    """Honour ``pgtrigger.ignore`` for the table's owner only (see ``OWNER_ONLY_IGNORE_SQL``).

    A DECLARE initializer runs before pgtrigger's own ignore check in the body.
    """

    def get_declare(self, model: Any) -> list[tuple[str, str]]:
        return [
            *super().get_declare(model),
            ("_k2b_owner", 'BOOLEAN := "public"._k2b_refuse_foreign_ignore(TG_NAME, TG_RELID)'),
        ]


class GuardedFSM(OwnerOnlyIgnore, pgtrigger.FSM):
    """pgtrigger's state machine, whose function runs only for a transition it refuses.

    The list of allowed transitions is in the trigger's ``WHEN`` clause, which the
    server evaluates in C as part of the row's update. pgtrigger's own FSM calls
    its function for every change of the field and checks the list there. That
    costs three PL/pgSQL calls (the function, the owner-only ignore check,
    pgtrigger's ignore check with its exception block), each with its pinned
    ``search_path`` to set and restore. A claim and an end both change a run's
    status: that was about 30 µs of the server's CPU each, some 13% of a no-op
    task's. An allowed transition now calls nothing. A refused one calls the same
    function as before, so the owner's ``pgtrigger.ignore`` and the refusal of
    anyone else's work as they did.
    """

    def get_condition(self, model: Any) -> pgtrigger.Condition:
        column = pgtrigger.utils.quote(model._meta.get_field(self.field).column)
        allowed = ",".join(f"{old}{self.separator}{new}" for old, new in self.transitions)
        return pgtrigger.Condition(
            f"OLD.{column} IS DISTINCT FROM NEW.{column} AND NOT"
            f" (pg_catalog.concat(OLD.{column}, '{self.separator}', NEW.{column})"
            f" = ANY('{{{allowed}}}'::text[]))"
        )


class GuardedProtect(OwnerOnlyIgnore, pgtrigger.Protect):
    pass


class Refuse(GuardedProtect):
    """A ``GuardedProtect`` whose refusal says what it refuses and why, in its own words.

    pgtrigger's "Cannot update rows from k2b_run table" tells an operator reading a
    worker's log nothing about which rule a statement broke.
    """

    def __init__(self, *, message: str, **kwargs: Any) -> None:
        if "'" in message or "%" in message:
            raise ValueError("a refusal's message is SQL text: no quote, no %")
        self.message = message
        super().__init__(**kwargs)

    def get_func(self, model: Any) -> str:
        return (
            f"RAISE EXCEPTION 'k2b_workflows: {self.message}' "
            "USING ERRCODE = 'insufficient_privilege';"
        )


class RefuseTruncate(PinnedTrigger):
    """Refuse ``TRUNCATE``: row-level protections never see it, and it empties a table at once.

    A truncated journal made a woken run replay from nothing and charge the
    provider a second time. The runtime role has no TRUNCATE privilege anyway;
    this stops the owner too (``purgeworkflows`` deletes rows, it never truncates).
    """

    when = pgtrigger.Before
    operation = pgtrigger.Truncate
    level = pgtrigger.Statement

    def get_func(self, model: Any) -> str:
        return (
            "RAISE EXCEPTION 'k2b_workflows: % is append-only, TRUNCATE is refused', "
            "TG_TABLE_NAME USING ERRCODE = 'insufficient_privilege';"
        )


def append_only(name: str) -> list[pgtrigger.Trigger]:
    """The two triggers of an evidence table: no UPDATE or DELETE, no TRUNCATE."""
    return [
        GuardedProtect(name=name, operation=pgtrigger.Update | pgtrigger.Delete),
        RefuseTruncate(name=name.replace("append_only", "no_truncate")),
    ]


#: A worker's presence lock (``kernel/holders.py``): held, as a session advisory lock,
#: by its lease keeper's connection for as long as the process lives. ``{worker}``:
#: an SQL text expression of the worker's id.
PRESENCE_LOCK = "pg_catalog.hashtextextended('k2b.worker:' || {worker}, 0)"


class SlotRelease(PinnedTrigger):
    """A run that ends gives its concurrency slot up once its action has left ``run()``.

    On the row itself, so no path that ends a run (its last step, a failure, a
    cancel, an operator's resolution, a hand-written ``UPDATE``) can keep it.
    But not while its holder may still be inside ``run()`` (#35, #47): a run
    canceled (by an operator, its timeout or ``cancel_in_progress``) while its
    worker is inside ``run()`` keeps the slot until that worker has left
    ``run()`` or is gone. Freed at the cancel, the next run of a limit-1 key
    entered the provider beside the canceled one.

    - The run's own end, written by its worker from ``running``, clears the
      lease in the same statement: the slot goes with it.
    - Once ended, the slot goes when the lease is cleared or has run out, and
      the holder (``claimed_by``) is gone: its presence lock can be taken. The
      holder itself clears the lease on the connection that holds that lock
      (``LeaseKeeper.leave``), where taking it again succeeds. So a lease
      rewritten by the runtime role, to the past or to NULL, frees nothing
      while the holder is there; a holder without a presence lock (one that
      could not take it) frees the slot with its lease, as before.
    - The holder's name of an ended run that holds a slot never changes: that
      name is what the release asks about.
    """

    when = pgtrigger.Before
    operation = pgtrigger.Update

    def get_func(self, model: Any) -> str:
        ended = "('succeeded', 'failed', 'canceled')"
        lock = PRESENCE_LOCK.format(worker="OLD.claimed_by")
        return (
            f"IF OLD.status IN {ended} AND NEW.claimed_by IS DISTINCT FROM OLD.claimed_by THEN "
            "RAISE EXCEPTION 'k2b_workflows: the holder of an ended run that holds a slot "
            "never changes' USING ERRCODE = 'insufficient_privilege'; END IF; "
            "IF NEW.lease_expires_at IS NULL AND OLD.status NOT IN " + ended + " THEN "
            "NEW.holds_slot := false; "
            'ELSIF (NEW.lease_expires_at IS NULL OR NEW.lease_expires_at <= "public".k2b_now()) '
            f"AND (OLD.claimed_by = '' OR pg_catalog.pg_try_advisory_xact_lock({lock})) THEN "
            "NEW.holds_slot := false; END IF; RETURN NEW;"
        )


class SlotAdmit(PinnedTrigger):
    """A freed slot, or a keyed run newly queued without one: admit who is next for the key.

    ``k2b_flow_admit`` takes no limit (#35): it reads the limit from the key's
    holders and the run it admits, which the runtime role cannot change.
    """

    when = pgtrigger.After

    def get_func(self, model: Any) -> str:
        return (
            'PERFORM "public".k2b_flow_admit(NEW.workflow_name, NEW.concurrency_key); RETURN NULL;'
        )


class SlotNeverInserted(PinnedTrigger):
    """A run is never written holding a slot: only admission (``k2b_flow_admit``) gives one.

    The runtime role may not UPDATE ``holds_slot`` (``roles.py``), but it
    inserts runs: without this, an inserted row holding a slot would be one
    more run inside a full key (#35).
    """

    when = pgtrigger.Before
    operation = pgtrigger.Insert

    def get_func(self, model: Any) -> str:
        return (
            "RAISE EXCEPTION 'k2b_workflows: a run is inserted without a slot "
            "(admission gives it one)' USING ERRCODE = 'insufficient_privilege';"
        )


class FairLine(PinnedTrigger):
    """A run that takes turns (``fairness_key``) gets its place in the claim's line.

    Start-time fair queuing on one index (``k2b_fair_line``, migration 0036):
    the place is the key's last queued run's place plus a step (100 µs /
    weight), but never earlier than the head of the queue's turns. Written
    whenever the run is queued due (its insert, its re-queue, a new
    ``run_after``); a run not due yet stands at its ``run_after`` like a run
    without a key. In the database, so that every path that queues a run (a
    start, ``enqueue_many``'s ``COPY``, a retry, a wake) places it alike; the rows
    of one statement see those inserted before them.
    """

    when = pgtrigger.Before

    def get_func(self, model: Any) -> str:
        return (
            'NEW.fair_line := "public".k2b_fair_line('
            "NEW.id, NEW.queue, NEW.fairness_key, NEW.fairness_weight, NEW.run_after); "
            "RETURN NEW;"
        )
