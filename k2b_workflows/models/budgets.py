"""A root run's budget and the charges its tree paid: the rows that keep a tree under its limits.

A budget spent from many workers at once must never be overshot: every
charge locks the root's account row, so concurrent children serialize on it,
and a charge is unique per step and unit, so a step retried after a crash
cannot pay twice. Charges are append-only (a trigger refuses UPDATE/DELETE).
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from ..triggers import append_only


class BudgetAccount(models.Model):
    """The root run's budget: limits and what the whole tree has spent.

    Every charge locks this row, so concurrent children serialize on it and
    can never overshoot.
    """

    root = models.OneToOneField(
        "k2b_workflows.WorkflowRun",
        primary_key=True,
        on_delete=models.PROTECT,
        related_name="budget",
    )
    effect_budget = models.JSONField(default=dict, blank=True)
    max_ai_calls = models.IntegerField(null=True, blank=True)
    max_steps = models.IntegerField(null=True, blank=True)
    spent = models.JSONField(default=dict, blank=True)
    ai_calls = models.IntegerField(default=0)
    children = models.IntegerField(default=0)
    #: HMAC under the evidence key over the root and its three limits, written with
    #: the account (``seals.limits_seal``, #47). The runtime role cannot change a
    #: limit (``roles.FROZEN_COLUMNS``); the table's owner can, and raising a
    #: budget of one charge to 100 let three charges through unseen. A charge
    #: refuses limits that do not match it, and ``verifyworkflows`` names them.
    limits_seal = models.CharField(max_length=100, blank=True, default="", db_default="")

    class Meta:
        db_table = "k2b_budget_account"

    def __str__(self) -> str:
        return f"budget of {self.root_id}"


class BudgetCharge(models.Model):
    """One unit of cost paid by one step: unique per root, run, step and unit."""

    account = models.ForeignKey(BudgetAccount, on_delete=models.PROTECT, related_name="charges")
    run = models.ForeignKey(
        "k2b_workflows.WorkflowRun", on_delete=models.PROTECT, related_name="charges"
    )
    seq = models.IntegerField()
    unit = models.CharField(max_length=100)
    amount = models.IntegerField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "k2b_budget_charge"
        constraints = [
            models.UniqueConstraint(
                fields=["account", "run", "seq", "unit"], name="k2b_charge_once_per_step"
            )
        ]
        triggers = append_only("charge_append_only")

    def __str__(self) -> str:
        return f"{self.amount} {self.unit} for {self.run_id} #{self.seq}"
