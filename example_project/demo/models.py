"""The demo shop's own tables, and a simulated payment provider and mail outbox."""

from django.db import models


class Order(models.Model):
    sku = models.CharField(max_length=50)
    items = models.JSONField(default=list)
    amount_cents = models.IntegerField()
    customer = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"order {self.pk} ({self.sku})"


class Approval(models.Model):
    """Written by a person (or the demo) when a large order is approved."""

    order = models.OneToOneField(Order, on_delete=models.CASCADE)
    approved_by = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"approval of {self.order_id}"


class Payment(models.Model):
    """The simulated payment provider's side: one row per charge it made."""

    idempotency_key = models.CharField(max_length=200, unique=True)
    amount_cents = models.IntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"payment {self.idempotency_key}"


# --8<-- [start:outbox_model]
class OutboxEmail(models.Model):
    """The simulated mail provider: deduplicated by message key."""

    key = models.CharField(max_length=200, unique=True)  # insert_once's key
    to = models.CharField(max_length=200)
    subject = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.subject


# --8<-- [end:outbox_model]


class Shipment(models.Model):
    key = models.CharField(max_length=200, unique=True)
    order = models.ForeignKey(Order, on_delete=models.CASCADE)
    item = models.CharField(max_length=100)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.item} for {self.order_id}"
