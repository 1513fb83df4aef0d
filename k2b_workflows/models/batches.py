"""A batch of task calls: its callbacks, and whether they were enqueued (#50).

The failure this row is built around: counter batches. A batch that counts
its members down (one row updated per member's end) has a hot row every
member's end waits on, and a crash between a member's end and the decrement
stalls the batch for ever: its callbacks never run. Here the members say
nothing to this row. They carry the batch's id in their sealed input, and a
worker's housekeeping asks the runs themselves whether any member has not
finished yet (an index walk over the batch's members, ``k2b_run_batch``);
the first pass that finds none enqueues the callbacks and marks this row in
one transaction. A crash anywhere leaves either both or neither, and the next
pass of any worker finds the batch again.
"""

from __future__ import annotations

import uuid

from django.db import models


class TaskBatch(models.Model):
    """The calls ``enqueue_batch`` enqueued together, and the callbacks their end enqueues.

    Written by ``kernel/batches.py`` alone: inserted with its members, in the
    caller's transaction; marked finished by the pass that enqueues its
    callbacks. ``callbacks`` (each callback's workflow and run input, built and
    checked at the enqueue) is sealed with the row's id, task and size: the
    runtime role can write this row, and a callback changed here would start
    what nobody enqueued, so a row whose seal fails is refused, not fired.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    #: The members' task.
    task_path = models.CharField(max_length=200)
    #: How many calls the batch was enqueued with.
    total = models.PositiveIntegerField()
    #: "on_finish" / "on_success" / "on_failure" -> {"workflow": name, "input": run input}.
    callbacks = models.JSONField(default=dict)
    seal = models.CharField(max_length=200)
    created_at = models.DateTimeField()
    #: When the pass that found every member finished enqueued the callbacks.
    finished_at = models.DateTimeField(null=True, blank=True)
    #: "successful" (every member succeeded) or "failed" (one at least did not); "" until
    #: then; "refused": the row failed its seal, and its callbacks were not enqueued.
    outcome = models.CharField(max_length=20, blank=True, default="")
    #: The callbacks' runs: callback name -> run id, as enqueued.
    callback_runs = models.JSONField(null=True, blank=True)

    class Meta:
        db_table = "k2b_task_batch"
        ordering = ["-created_at"]
        verbose_name = "task batch"
        verbose_name_plural = "task batches"
        indexes = [
            # The housekeeping's walk: only the batches not finished yet.
            models.Index(
                fields=["created_at"],
                condition=models.Q(finished_at__isnull=True),
                name="k2b_task_batch_open",
            ),
        ]

    def __str__(self) -> str:
        return f"batch {self.id} of {self.task_path}"
