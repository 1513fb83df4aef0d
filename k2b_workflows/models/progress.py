"""A run's progress: what its running step last said of how far it got (#49).

The failure this row is built around: progress written on the run's own row,
in the step's transaction. A step that rolls back takes its progress with it,
nobody sees a value before the step commits (a ten-minute step shows 0% for
ten minutes, then 100%), and a tight loop reporting each item turns the run
row, the one every fence locks and every trigger guards, into a hot spot. So
progress is a row of its own, one per run, upserted on a connection of its
own (``kernel/progress.py``), a few times a second at most.

Display only: nothing a worker decides reads it, so the runtime role may write
it (``roles.py``); what it could forge is a bar.
"""

from __future__ import annotations

from django.db import models

#: The longest note ``set_progress`` takes, in characters.
MAX_NOTE = 500


class RunProgress(models.Model):
    """How far a run's step got: ``done`` of ``total`` (None: unknown), and a note.

    Written only by ``kernel/progress.py``. Not a foreign key to the run: its
    check would lock the run row (``FOR KEY SHARE``) at every write, the row
    every step fences. Retention deletes it with its run (``retention.py``).
    """

    run_id = models.UUIDField(primary_key=True)
    #: The generation of the execution that wrote it: a stale one never overwrites a newer one.
    generation = models.BigIntegerField()
    done = models.BigIntegerField()
    total = models.BigIntegerField(null=True, blank=True)
    note = models.CharField(max_length=MAX_NOTE, blank=True, default="")
    #: When the step set this value (the kernel's clock), not when it was written.
    updated_at = models.DateTimeField()

    class Meta:
        db_table = "k2b_progress"
        verbose_name = "run progress"
        verbose_name_plural = "run progress"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(done__gte=0), name="k2b_progress_done_not_negative"
            ),
            models.CheckConstraint(
                condition=models.Q(total__isnull=True) | models.Q(total__gte=models.F("done")),
                name="k2b_progress_total_not_below_done",
            ),
        ]

    def __str__(self) -> str:
        total = "?" if self.total is None else self.total
        return f"{self.done}/{total}"
