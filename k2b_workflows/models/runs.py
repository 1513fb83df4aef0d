"""A run: its row, its statuses and lifecycle, and where it stands in the queue.

The invariants that must survive a buggy worker or a hand-written ``UPDATE``
live in the database as triggers (django-pgtrigger): ``generation`` never
decreases, and ``status`` only takes the transitions of the run lifecycle.
The rows that hang on a run's steps are in modules of their own (``journal``,
``waits``, ``dedup``, ``attempts``).
"""

from __future__ import annotations

import uuid

import pgtrigger
from django.db import models
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Coalesce
from django.utils import timezone
from django.utils.deconstruct import deconstructible

from .. import naming
from ..triggers import (
    FairLine,
    GuardedFSM,
    GuardedProtect,
    Notify,
    NotifyEnded,
    Refuse,
    SlotAdmit,
    SlotNeverInserted,
    SlotRelease,
)

#: The channel a run's end is announced on, with the run's id as payload.
ENDED_CHANNEL = NotifyEnded.channel
#: The statuses ``wait_for_workflow_run`` returns for: the run will not move on its own.
SETTLED_STATUSES = ("succeeded", "failed", "canceled", "needs_attention")


class RunStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    WAITING = "waiting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    NEEDS_ATTENTION = "needs_attention"


TERMINAL_STATUSES = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELED)
FINAL_STATUSES = (RunStatus.SUCCEEDED, RunStatus.CANCELED)

#: The run lifecycle. ``running -> running`` is not a transition: a takeover
#: keeps the status and raises ``generation``.
RUN_TRANSITIONS = [
    ("queued", "running"),
    ("queued", "canceled"),
    ("running", "queued"),
    ("running", "waiting"),
    ("running", "succeeded"),
    ("running", "failed"),
    ("running", "needs_attention"),
    ("running", "canceled"),
    ("waiting", "queued"),
    ("waiting", "canceled"),
    ("needs_attention", "queued"),
    ("needs_attention", "succeeded"),
    ("needs_attention", "canceled"),
    ("failed", "queued"),
]


#: Where a run holds its ``unique_key`` (``unique.STATE_SETS`` gives the codes): READY
#: (queued, never claimed) always; RUNNING (claimed once and not ended: running,
#: waiting, parked for an operator, queued again) for codes 2-5; SUCCEEDED for 3 and
#: 5; FAILED or CANCELED for 4 and 5. ``kernel/uniques.HELD_SQL`` is the same, in SQL.
UNIQUE_HELD = models.Q(unique_key__isnull=False) & (
    models.Q(status="queued", generation=0)
    | (
        models.Q(unique_states__gte=2)
        & (
            models.Q(status__in=["running", "waiting", "needs_attention"])
            | models.Q(status="queued", generation__gt=0)
        )
    )
    | models.Q(unique_states__in=[3, 5], status="succeeded")
    | models.Q(unique_states__in=[4, 5], status__in=["failed", "canceled"])
)


# Migrations name it by the path it had before the models became a package.
@deconstructible(path="k2b_workflows.models.QueueOrder")
class QueueOrder(models.Func):
    """``k2b_queue_order(run_after, priority_credit_ms)``: where a queued run stands in line.

    Its ``run_after`` moved earlier by its priority's credit, so that the claim
    walks one index in this order (created by migration 0016; see ``kernel/flow.py``).
    """

    function = "k2b_queue_order"
    output_field = models.DateTimeField()


#: Where a queued run stands in the claim's line: its place among the keys' turns
#: when it takes turns (``fair_line``), else its ``run_after``, moved earlier by its
#: priority's credit (``kernel/flow.py``, ``triggers.FairLine``).
LINE = QueueOrder(Coalesce("fair_line", "run_after"), "priority_credit_ms")


class WorkflowRun(models.Model):
    """One execution of a workflow: queued, claimed under a lease, parked, finished."""

    Status = RunStatus

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    workflow_name = models.CharField(max_length=200)
    workflow_version = models.PositiveIntegerField(default=1)
    app_id = models.CharField(max_length=100)
    status = models.CharField(max_length=20, choices=RunStatus.choices, default=RunStatus.QUEUED)
    input = models.JSONField()
    output = models.JSONField(null=True, blank=True)
    error_code = models.CharField(max_length=100, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    #: What an operator needs to see beside ``error_code`` while the run needs
    #: attention: both sides of a nondeterministic replay (names and hashes,
    #: never inputs), or a workflow's traceback.
    error_detail = models.JSONField(null=True, blank=True)
    # NULL, not "": runs without a key must not collide on the unique constraint.
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    principal = models.JSONField(null=True, blank=True)

    # Claiming, leases and the fence.
    generation = models.BigIntegerField(default=0)
    consecutive_failures = models.PositiveIntegerField(default=0)
    run_after = models.DateTimeField(default=timezone.now)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    claimed_by = models.CharField(max_length=200, blank=True, default="")
    #: The workers whose lease on the run expired (a crash, a freeze), in order, as
    #: the reap read ``claimed_by``: a task's ``TaskResult.worker_ids`` names the
    #: workers of its crashed attempts from it (#37). NULL: none.
    lease_lost_by = models.JSONField(null=True, blank=True, editable=False)
    #: The django.tasks queue a task run was enqueued on (``runworkflows --queue``);
    #: workflow runs are on "default" (#37).
    #: With a database default too: a row inserted by hand or by an older release's
    #: code (a rolling deploy, a seed script) lands on the default queue.
    queue = models.CharField(max_length=100, default="default", db_default="default")
    #: A task run's task, as its input names it: what the runs list shows without
    #: reading inputs (#37). Empty for workflow runs.
    task_path = models.CharField(max_length=200, blank=True, default="", db_default="")
    current_step = models.IntegerField(null=True, blank=True)
    #: The step whose effect an operator must resolve (``needs_attention`` only).
    attention_step = models.IntegerField(null=True, blank=True)

    # Flow control (``kernel/flow.py``): a run's key, its workflow's limit when it
    # started, whether it holds one of the key's slots, and its place in line.
    # NULL, not "": runs without a key are not limited.
    concurrency_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    concurrency_limit = models.IntegerField(null=True, blank=True)
    holds_slot = models.BooleanField(default=False)
    priority = models.IntegerField(default=0)
    #: ``priority`` x ``PRIORITY_AGING_MS`` when the run started: how much earlier
    #: than its ``run_after`` it stands in line.
    priority_credit_ms = models.BigIntegerField(default=0)
    #: The rate limit key that last deferred the run ("" if none did).
    deferred_by = models.CharField(max_length=500, blank=True, default="")
    #: Fair shares (``fairness.py``, ``triggers.FairLine``): the key whose turn the run
    #: takes (NULL: none), its weight, and its place in line among the keys' runs,
    #: which the database writes when the run is queued due (``triggers.FairLine``).
    fairness_key = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001
    fairness_weight = models.FloatField(default=1.0, db_default=1.0)
    fair_line = models.DateTimeField(null=True, blank=True, editable=False)

    # Tree of runs: children are normal runs created by a parent's step.
    # No index of its own: k2b_run_child_once (parent, parent_step, child_index)
    # serves every lookup by parent, and most runs have none.
    parent = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="children",
        db_index=False,
    )
    parent_step = models.IntegerField(null=True, blank=True)
    child_index = models.IntegerField(null=True, blank=True)
    root = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="descendants"
    )
    #: The run this one was forked from (``fork_workflow_run``): it kept that run's
    #: journal before the fork point and ran on from there. Its forks are
    #: ``run.forks``. Covered by the start seal when set. No index of its own: the
    #: partial ``k2b_run_forks`` serves the reverse lookup, and most runs are no fork.
    forked_from = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="forks",
        db_index=False,
        editable=False,
    )

    # What a waiting run waits for; kept after a wake so a second park on the
    # same key knows which signals it has already seen.
    wait_kind = models.CharField(max_length=200, blank=True, default="")
    wait_key = models.CharField(max_length=500, blank=True, default="")
    wait_deadline = models.DateTimeField(null=True, blank=True)
    waiting_since = models.DateTimeField(null=True, blank=True)
    wait_step = models.IntegerField(null=True, blank=True)
    #: The action of the step that parked at ``wait_step``: a parked step has no
    #: journal entry, so this is what replay compares a changed workflow with.
    wait_action = models.CharField(max_length=200, blank=True, default="")
    wait_signal_seq = models.BigIntegerField(default=0)

    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    #: Its workflow's ``timeout`` after the start: not ended by then, it is canceled
    #: with ``WORKFLOW_TIMEOUT`` (``worker/timeouts.py``). None: no timeout.
    timeout_at = models.DateTimeField(null=True, blank=True)
    #: When ``tasks.cancel`` asked the running call of a task run to stop (#49): the
    #: call is asked, not cut, and no further attempt of it starts
    #: (``Execution.execute``, ``RunEnding``). NULL: never asked. Not sealed: the
    #: runtime role that could forge it may cancel the run outright anyway.
    cancel_requested_at = models.DateTimeField(null=True, blank=True, editable=False)
    #: Why, as ``tasks.cancel`` was told: the run's error message if it ends canceled.
    cancel_reason = models.TextField(blank=True, default="", db_default="", editable=False)

    #: The ``WorkflowSchedule.schedule_id`` that started the run, and the tick it
    #: ran for; NULL for runs started otherwise. A string, not a foreign key: a
    #: deleted schedule leaves its runs (and their evidence) as they are.
    schedule_id = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001
    scheduled_for = models.DateTimeField(null=True, blank=True)

    #: Keyed seals over (entry count, head) of the journal and the ledger, rewritten
    #: with every entry: a deleted tail no longer matches (``kernel/evidence.py``).
    journal_anchor = models.CharField(max_length=100, blank=True, default="", editable=False)
    ledger_anchor = models.CharField(max_length=100, blank=True, default="", editable=False)
    #: How many entries the journal holds, set by the statement that appends them (and
    #: seals ``journal_anchor``): an append matches only the length it chains onto, so
    #: a stale or repeated one inserts nothing, without counting the journal's rows.
    #: Not evidence (the anchor is): a guard of the writers' order.
    journal_length = models.IntegerField(default=0, db_default=0, editable=False)
    #: Keyed seals over the row's own fields (``kernel/seals.py``): what the run was
    #: started with, and how it ended (status, output, error code, generation).
    start_seal = models.CharField(max_length=100, blank=True, default="", editable=False)
    end_seal = models.CharField(max_length=100, blank=True, default="", editable=False)
    #: How often the run may be tried again is the key holder's (#47). The kernel is the
    #: only writer that may lower ``consecutive_failures`` (a completed step, a park, an
    #: operator's retry), and each such reset raises ``attempts_seq`` and seals the new
    #: number (``seals.attempts_seal``); the database refuses a lower count without a
    #: higher number, and a number that never decreases (``Meta.triggers``). A claim
    #: checks the seal of any number above 0 before a step runs: a reset forged with a
    #: number of its own has no seal. Raising the count needs neither: it only ends
    #: retries sooner, and a crash's takeover counts it in SQL.
    attempts_seq = models.BigIntegerField(default=0, db_default=0, editable=False)
    attempts_seal = models.CharField(
        max_length=100, blank=True, default="", db_default="", editable=False
    )

    #: The W3C trace context of the code that started the run (``traceparent``,
    #: ``tracestate``) and of the newest attempt (``attempt``, ``attempt_generation``):
    #: the run's spans join the caller's trace on whichever worker runs it, and an
    #: attempt after a takeover links to the one that died (``tracing.py``). NULL
    #: when nothing was tracing.
    trace_context = models.JSONField(null=True, blank=True, editable=False)
    #: A ``Unique`` declaration's key of this call (``kernel/uniques.py``): a hash of
    #: the task path (or workflow name) and the key's arguments; NULL: none, or let go.
    unique_key = models.CharField(  # noqa: DJ001
        max_length=64, null=True, blank=True, editable=False
    )
    #: Where the run holds ``unique_key``: ``unique.STATE_SETS``' code of its states.
    unique_states = models.SmallIntegerField(default=0, db_default=0, editable=False)

    class Meta:
        db_table = "k2b_run"
        ordering = ["-created_at"]
        permissions = [
            ("resolve_effect", "Can resolve an ambiguous effect"),
            ("cancel_workflowrun", "Can cancel a workflow run"),
            ("retry_workflowrun", "Can retry a failed workflow run"),
            ("fork_workflowrun", "Can fork a workflow run from a step"),
            # A dry run executes actions' plan(), cost(), authorize() and PURE run()
            # in the web process: more than viewing.
            ("dry_run_workflow", "Can dry-run a workflow from the admin"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["workflow_name", "idempotency_key"],
                condition=models.Q(idempotency_key__isnull=False),
                name="k2b_run_idempotency_key",
            ),
            models.UniqueConstraint(
                fields=["parent", "parent_step", "child_index"],
                condition=models.Q(parent__isnull=False),
                name="k2b_run_child_once",
            ),
            # One run per unique key in the states that hold it (``kernel/uniques.py``):
            # a second start waits for the first one's transaction, not a look-then-insert.
            models.UniqueConstraint(
                fields=["unique_key"], condition=UNIQUE_HELD, name="k2b_run_unique_key"
            ),
        ]
        indexes = [
            # The claim's walk: claimable queued runs in line order (``kernel/flow.py``).
            # A keyed run without a slot is not in it, so a backlog behind busy keys
            # costs the claim nothing.
            models.Index(
                LINE,
                condition=models.Q(status="queued")
                & (models.Q(concurrency_key__isnull=True) | models.Q(holds_slot=True)),
                name="k2b_run_queued",
            ),
            # When the next delayed run with a priority is due (its line order is earlier).
            models.Index(
                fields=["run_after"],
                condition=models.Q(status="queued", priority_credit_ms__gt=0)
                & (models.Q(concurrency_key__isnull=True) | models.Q(holds_slot=True)),
                name="k2b_run_queued_priority",
            ),
            # Slot holders per key: what admission counts, under the key's lock.
            models.Index(
                fields=["workflow_name", "concurrency_key"],
                condition=models.Q(holds_slot=True),
                name="k2b_run_slots",
            ),
            # Runs waiting for a slot, per key, in line order: who admission takes next.
            models.Index(
                "workflow_name",
                "concurrency_key",
                QueueOrder("run_after", "priority_credit_ms"),
                condition=models.Q(
                    status="queued", holds_slot=False, concurrency_key__isnull=False
                ),
                name="k2b_run_behind_key",
            ),
            # Keyed runs without a slot by the time they are due: admission takes
            # only due runs, and the housekeeping admits those that became due (#35).
            models.Index(
                fields=["run_after"],
                condition=models.Q(
                    status="queued", holds_slot=False, concurrency_key__isnull=False
                ),
                name="k2b_run_delayed_keyed",
            ),
            # Running runs, keyed by id and not by lease_expires_at: a step's fenced
            # write (``WHERE id = ... AND status = 'running'``) finds its row through
            # it, and renewing a lease changes no indexed column, so the update is
            # HOT (no index entries; see the table's fillfactor in migration 0010).
            # The reaper reads the few running rows through it.
            models.Index(
                fields=["id"],
                condition=models.Q(status="running"),
                name="k2b_run_running",
            ),
            models.Index(
                fields=["app_id", "wait_kind", "wait_key"],
                condition=models.Q(status="waiting"),
                name="k2b_run_waiting",
            ),
            models.Index(
                fields=["wait_deadline"],
                condition=models.Q(status="waiting", wait_deadline__isnull=False),
                name="k2b_run_deadline",
            ),
            # The claim of a worker given ``--queue``: the same walk as k2b_run_queued,
            # one queue at a time, so a worker of a small queue never reads a large one.
            models.Index(
                "queue",
                LINE,
                condition=models.Q(status="queued")
                & (models.Q(concurrency_key__isnull=True) | models.Q(holds_slot=True)),
                name="k2b_run_queued_queue",
            ),
            # Fair shares (``triggers.FairLine``): the head of a queue's turns, and
            # where a key's last queued run stands; a run without a key has no entry.
            models.Index(
                "queue",
                "fair_line",
                condition=models.Q(status="queued", fair_line__isnull=False),
                name="k2b_run_fair_head",
            ),
            models.Index(
                "queue",
                "fairness_key",
                "fair_line",
                condition=models.Q(status="queued", fair_line__isnull=False),
                name="k2b_run_fair_key",
            ),
            models.Index(fields=["status", "created_at"], name="k2b_run_status"),
            # The Queues page (#49): a queue's runs per status, each count stopped at a
            # cap, and what it finished in the last minutes, without reading the rest.
            models.Index(fields=["queue", "status", "finished_at"], name="k2b_run_queue_status"),
            # The runs list's filter by task (#51): the task paths present, one index
            # descent each, and one task's calls. Partial: a workflow run has no entry.
            models.Index(
                fields=["task_path"], condition=~models.Q(task_path=""), name="k2b_run_task_path"
            ),
            # A run's forks (its page lists them). Partial: a run that is no fork has
            # no entry, so neither an enqueue nor a status change pays for it.
            models.Index(
                fields=["forked_from"],
                condition=models.Q(forked_from__isnull=False),
                name="k2b_run_forks",
            ),
            # The overview's throughput and error codes, and retention's oldest first:
            # index-only over the window, whatever the size of the table.
            models.Index(
                fields=["finished_at"],
                include=["status", "error_code"],
                condition=models.Q(finished_at__isnull=False),
                name="k2b_run_finished",
            ),
            # The timeout sweep's walk: only runs with a timeout that may still move.
            models.Index(
                fields=["timeout_at"],
                condition=models.Q(
                    timeout_at__isnull=False, status__in=["queued", "running", "waiting"]
                ),
                name="k2b_run_timeout",
            ),
            # A schedule's runs, newest tick first (its admin page), and the ones
            # not ended yet (overlap). Partial: runs started otherwise have no entry,
            # so neither an enqueue nor a status change of theirs pays for them.
            models.Index(
                fields=["schedule_id", "scheduled_for"],
                condition=models.Q(schedule_id__isnull=False),
                name="k2b_run_schedule",
            ),
            models.Index(
                fields=["schedule_id"],
                condition=models.Q(
                    schedule_id__isnull=False,
                    status__in=["queued", "running", "waiting", "needs_attention"],
                ),
                name="k2b_run_schedule_active",
            ),
            # A batch's members by status (#50): whether any has not finished (the
            # housekeeping's question before a batch's callbacks), its counts, its
            # page. Partial: a run outside a batch has no entry, so neither its
            # enqueue nor its end pays for it.
            models.Index(
                KeyTextTransform("batch", "input"),
                "status",
                condition=models.Q(input__has_key="batch"),
                name="k2b_run_batch",
            ),
        ]
        triggers = [
            GuardedFSM(
                name="status_transitions",
                field="status",
                # Its function is called only for a change of status not in the list
                # (``GuardedFSM``): never for a step's fence, a lease renewal, a claim
                # or an end.
                transitions=RUN_TRANSITIONS,
            ),
            GuardedProtect(
                name="generation_never_decreases",
                operation=pgtrigger.Update,
                condition=pgtrigger.Q(new__generation__lt=pgtrigger.F("old__generation")),
            ),
            # How often a step may run again (#47): a reset of the failure count, and a
            # run put back in line after it failed or needed an operator, carry a new
            # sealed ``attempts_seq`` (``kernel/seals.py``); the number never goes back.
            Refuse(
                name="attempts_seq_never_decreases",
                operation=pgtrigger.Update,
                condition=pgtrigger.Q(new__attempts_seq__lt=pgtrigger.F("old__attempts_seq")),
                message="the attempts_seq of a run never decreases",
            ),
            Refuse(
                name="failures_reset_by_the_kernel",
                operation=pgtrigger.Update,
                condition=pgtrigger.Q(
                    new__consecutive_failures__lt=pgtrigger.F("old__consecutive_failures")
                )
                & pgtrigger.Q(new__attempts_seq=pgtrigger.F("old__attempts_seq"))
                & ~pgtrigger.Q(new__status="succeeded"),
                message="the failure count of a run is lowered only by the kernel,"
                " under a new sealed attempts_seq",
            ),
            Refuse(
                name="requeue_after_end_by_the_kernel",
                operation=pgtrigger.Update,
                condition=pgtrigger.Q(old__status__in=["failed", "needs_attention"])
                & pgtrigger.Q(new__status="queued")
                & pgtrigger.Q(new__attempts_seq__lte=pgtrigger.F("old__attempts_seq")),
                message="a failed run, or one waiting for an operator, is queued again"
                " only with a new sealed attempts_seq",
            ),
            SlotRelease(
                name="slot_release",
                condition=pgtrigger.Q(old__holds_slot=True)
                & pgtrigger.Q(new__status__in=[str(s) for s in TERMINAL_STATUSES]),
            ),
            SlotNeverInserted(
                name="slot_never_inserted",
                condition=pgtrigger.Q(new__holds_slot=True),
            ),
            SlotAdmit(
                name="slot_admit_insert",
                operation=pgtrigger.Insert,
                condition=pgtrigger.Q(new__concurrency_key__isnull=False)
                & pgtrigger.Q(new__status="queued"),
            ),
            SlotAdmit(
                name="slot_admit_update",
                operation=pgtrigger.Update,
                condition=pgtrigger.Q(new__concurrency_key__isnull=False)
                & pgtrigger.Q(new__holds_slot=False)
                & (
                    pgtrigger.Q(old__holds_slot=True)
                    | (
                        pgtrigger.Q(new__status="queued")
                        & pgtrigger.Q(old__status__df=pgtrigger.F("new__status"))
                    )
                ),
            ),
            # Fair shares: a run queued due gets its place among the keys' turns.
            FairLine(
                name="fair_line_insert",
                operation=pgtrigger.Insert,
                condition=pgtrigger.Q(new__fairness_key__isnull=False)
                & pgtrigger.Q(new__status="queued"),
            ),
            FairLine(
                name="fair_line_update",
                operation=pgtrigger.Update,
                condition=pgtrigger.Q(new__fairness_key__isnull=False)
                & pgtrigger.Q(new__status="queued")
                & (
                    pgtrigger.Q(old__status__df=pgtrigger.F("new__status"))
                    | pgtrigger.Q(old__run_after__df=pgtrigger.F("new__run_after"))
                ),
            ),
            Notify(
                name="notify_queued_insert",
                operation=pgtrigger.Insert,
                condition=pgtrigger.Q(new__status="queued"),
            ),
            NotifyEnded(
                name="notify_ended",
                operation=pgtrigger.Update,
                condition=pgtrigger.Q(new__status__in=SETTLED_STATUSES)
                & pgtrigger.Q(old__status__df=pgtrigger.F("new__status")),
            ),
            Notify(
                name="notify_queued_update",
                operation=pgtrigger.Update,
                condition=pgtrigger.Q(new__status="queued")
                & (
                    pgtrigger.Q(old__status__df=pgtrigger.F("new__status"))
                    | pgtrigger.Q(old__run_after__df=pgtrigger.F("new__run_after"))
                ),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.display_name} {self.id}"

    @property
    def display_name(self) -> str:
        """What the run is called on every screen: its task's path for a task call (#51)."""
        return naming.display_name(self.workflow_name, self.task_path)

    @property
    def is_root(self) -> bool:
        return self.parent_id is None
