"""A run's journal and its evidence ledger: what replay returns, and what each effect did.

Both are append-only (triggers refuse ``UPDATE``, ``DELETE`` and ``TRUNCATE``, whatever a
buggy worker or a hand-written statement tries) and hash-chained per run.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from ..actions import Effect
from ..triggers import append_only
from .runs import WorkflowRun

_EFFECT_CHOICES = [(e.value, e.name.replace("_", " ").lower()) for e in Effect]


class JournalEntry(models.Model):
    """A step's final outcome, checkpointed: what replay returns instead of running it again.

    Append-only and hash-chained per run:
    ``entry_hash = HMAC(key, prev_hash ‖ canonical(entry))``, sealed by
    ``WorkflowRun.journal_anchor``.
    """

    class State(models.TextChoices):
        SUCCEEDED = "succeeded"
        FAILED = "failed"

    # No index of its own: the unique (run, seq) serves every lookup by run, and an
    # index less is one insert less per step.
    run = models.ForeignKey(
        WorkflowRun, on_delete=models.PROTECT, related_name="journal", db_index=False
    )
    seq = models.IntegerField()
    action_name = models.CharField(max_length=200)
    effect = models.CharField(max_length=20, choices=_EFFECT_CHOICES)
    state = models.CharField(max_length=20, choices=State.choices)
    output = models.JSONField(null=True, blank=True)
    summary = models.TextField(blank=True, default="")
    error_code = models.CharField(max_length=100, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    input_hash = models.CharField(max_length=64)
    generation = models.BigIntegerField()
    started_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    #: Id of the evidence key the hashes were made with; "" for unkeyed SHA-256
    #: (entries written before keyed chains).
    key_id = models.CharField(max_length=16, blank=True, default="")
    prev_hash = models.CharField(max_length=64)
    entry_hash = models.CharField(max_length=64)

    class Meta:
        db_table = "k2b_journal"
        ordering = ["run", "seq"]
        verbose_name_plural = "journal entries"
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="k2b_journal_step_once")]
        triggers = append_only("journal_append_only")

    def __str__(self) -> str:
        return f"{self.run_id} #{self.seq} {self.action_name} {self.state}"


class LedgerEntry(models.Model):
    """Evidence of one event of an effect: dispatch, result, reconcile answer, resolution.

    Holds hashes only, never raw input or credentials. Append-only and
    hash-chained per run like the journal.
    """

    class Kind(models.TextChoices):
        DISPATCHED = "dispatched"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        OUTCOME_UNKNOWN = "outcome_unknown"
        RECONCILED = "reconciled"
        RECONCILE_UNKNOWN = "reconcile_unknown"
        #: reconcile() says the provider has not finished: polled again later.
        PENDING = "pending"
        LATE_RESULT = "late_result"
        RESOLVED_CONFIRMED = "resolved_confirmed"
        RESOLVED_ABSENT = "resolved_absent"
        REJECTED = "rejected"
        CANCELED = "canceled"
        RETRIED = "retried"
        #: A fork: on the new run, who forked it from which step and why, the effects
        #: they allowed to run again and the effect keys it keeps; on the original,
        #: the fork's id.
        FORKED = "forked"

    # No index of its own: k2b_ledger_step (run, seq) serves every lookup by run.
    run = models.ForeignKey(
        WorkflowRun, on_delete=models.PROTECT, related_name="ledger", db_index=False
    )
    seq = models.IntegerField(null=True, blank=True)
    kind = models.CharField(max_length=30, choices=Kind.choices)
    action_name = models.CharField(max_length=200, blank=True, default="")
    effect = models.CharField(max_length=20, choices=_EFFECT_CHOICES, blank=True, default="")
    invocation_key = models.CharField(max_length=200, blank=True, default="")
    effect_key = models.CharField(max_length=200, blank=True, default="")
    generation = models.BigIntegerField(null=True, blank=True)
    definition_hash = models.CharField(max_length=64, blank=True, default="")
    input_hash = models.CharField(max_length=64, blank=True, default="")
    preview_hash = models.CharField(max_length=64, blank=True, default="")
    principal_hash = models.CharField(max_length=64, blank=True, default="")
    idempotency_key_hash = models.CharField(max_length=64, blank=True, default="")
    output_hash = models.CharField(max_length=64, blank=True, default="")
    message = models.TextField(blank=True, default="")
    #: Operator resolutions: who decided, and on what evidence.
    actor = models.CharField(max_length=150, blank=True, default="")
    actor_id = models.BigIntegerField(null=True, blank=True)
    evidence = models.TextField(blank=True, default="")
    detail = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    #: Id of the evidence key the hashes were made with; "" for unkeyed SHA-256
    #: (entries written before keyed chains).
    key_id = models.CharField(max_length=16, blank=True, default="")
    prev_hash = models.CharField(max_length=64)
    entry_hash = models.CharField(max_length=64)

    class Meta:
        db_table = "k2b_ledger"
        ordering = ["run", "id"]
        verbose_name_plural = "ledger entries"
        indexes = [models.Index(fields=["run", "seq"], name="k2b_ledger_step")]
        triggers = append_only("ledger_append_only")

    def __str__(self) -> str:
        return f"{self.run_id} #{self.seq} {self.kind}"
