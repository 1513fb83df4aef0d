"""Rate limits' rows: each admitted dispatch of a rate-limited action.

The sliding window of a rate limit must hold across every worker of a
fleet: it is counted from these rows, in the database, not in any process.
"""

from __future__ import annotations

from django.db import models


class RateDispatch(models.Model):
    """One admitted dispatch of a rate-limited action: what the sliding window counts.

    Reserved in a committed transaction before the effect, stamped with the
    database's clock just before ``run()`` (``kernel/flow.py``). Rows older than
    their own window are deleted by the next admission of their key, inside
    ``k2b_rate_admit``: the runtime role may only read this table (#35).
    """

    id = models.BigAutoField(primary_key=True)
    #: ``<action name>`` or ``<action name>:<rate_limit_key(input)>``.
    limit_key = models.CharField(max_length=500)
    #: When ``run()`` was about to be called; NULL while only reserved (it counts
    #: as a call made now until it is stamped).
    at = models.DateTimeField(null=True, blank=True)
    reserved_at = models.DateTimeField()
    #: The run's fence at the reservation: an unstamped one of an older life is void.
    generation = models.BigIntegerField()
    run = models.ForeignKey(
        "k2b_workflows.WorkflowRun",
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="+",
    )
    seq = models.IntegerField()
    #: The window the dispatch was admitted under (``per`` plus the margin): the row
    #: counts, and is kept, for that long after ``at`` whatever a later caller's
    #: window (#35). NULL for rows admitted before it was recorded.
    window_ms = models.BigIntegerField(null=True, blank=True)

    class Meta:
        db_table = "k2b_rate_dispatch"
        ordering = ["-at"]
        verbose_name = "rate-limited dispatch"
        indexes = [models.Index(fields=["limit_key", "at"], name="k2b_rate_dispatch_key_at")]

    def __str__(self) -> str:
        return f"{self.limit_key} at {self.at}"
