"""The admin overview's per-minute counts, computed once per minute that is over.

Counting a day of runs on every page view would cost as much as the table;
a minute counted once and read afterwards keeps the page's cost flat.
"""

from __future__ import annotations

from django.db import models


class OverviewMinute(models.Model):
    """Runs started or finished in one minute that is over, per status and error code.

    The admin's overview counts each minute from the runs table once, when it
    has been over for a while, and reads it from here afterwards: the page's
    cost is the last few minutes', however many runs the window holds. A row
    of kind ``rolled`` marks a minute as counted (a minute with no runs has no
    other row). Not evidence: the runtime role deletes rows older than two days.
    """

    class Kind(models.TextChoices):
        STARTED = "started"
        FINISHED = "finished"
        ROLLED = "rolled"

    minute = models.DateTimeField()
    kind = models.CharField(max_length=10, choices=Kind.choices)
    status = models.CharField(max_length=20, blank=True, default="")
    error_code = models.CharField(max_length=100, blank=True, default="")
    count = models.BigIntegerField()

    class Meta:
        db_table = "k2b_overview_minute"
        constraints = [
            models.UniqueConstraint(
                fields=["minute", "kind", "status", "error_code"], name="k2b_overview_minute_once"
            )
        ]

    def __str__(self) -> str:
        return f"{self.minute:%Y-%m-%d %H:%M} {self.kind} {self.status} {self.count}"
