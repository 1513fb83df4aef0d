"""The shop's own tables that the examples write to (the pages do not show them)."""

from django.conf import settings
from django.db import models


class Order(models.Model):
    sku = models.CharField(max_length=50)

    def __str__(self) -> str:
        return f"order {self.pk} ({self.sku})"


class Stock(models.Model):
    sku = models.CharField(max_length=50, unique=True)
    free = models.IntegerField()

    def __str__(self) -> str:
        return f"{self.sku}: {self.free} free"


class Approval(models.Model):
    order_id = models.BigIntegerField(unique=True)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT)

    def __str__(self) -> str:
        return f"approval of order {self.order_id}"


class Invoice(models.Model):
    number = models.CharField(max_length=50)
    order_id = models.BigIntegerField()

    def __str__(self) -> str:
        return f"invoice {self.number}"
