"""Test-only tables: a simulated external provider and a domain table."""

from django.db import models


class ProviderCall(models.Model):
    """Every call the simulated provider received; committed on its own (it is 'external')."""

    action = models.CharField(max_length=100)
    effect_key = models.CharField(max_length=200)
    invocation_key = models.CharField(max_length=200, blank=True, default="")
    generation = models.BigIntegerField(default=0)
    pid = models.IntegerField(default=0)
    payload = models.JSONField(null=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.action} {self.effect_key}"


class DomainRow(models.Model):
    """What a TRANSACTIONAL or fenced IDEMPOTENT action writes."""

    key = models.CharField(max_length=200, unique=True)
    value = models.JSONField(null=True)
    generation = models.BigIntegerField(default=0)
    pid = models.IntegerField(default=0)

    def __str__(self) -> str:
        return self.key


class Dedup(models.Model):
    """A user dedup table with two unique constraints, for ``insert_once``."""

    key = models.CharField(max_length=100, unique=True)
    run = models.CharField(max_length=100)
    step = models.IntegerField()
    recipient = models.CharField(max_length=100)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "step", "recipient"], name="tests_dedup_rsr")
        ]

    def __str__(self) -> str:
        return self.key
