"""The failed attempts of a django.tasks task: one row per ``TaskError`` (#37)."""

from __future__ import annotations

from django.db import models

from .runs import WorkflowRun


class TaskAttempt(models.Model):
    """One failed call of a django.tasks task function: its ``TaskError`` (#37).

    A task's successful attempt leaves no row (its success rides on the run's
    end, one commit); an attempt that raised leaves one, written in a fenced
    transaction before the run is retried or failed, so a stale worker cannot
    add an error to a run it lost. The traceback is scrubbed before it is stored,
    and the row is sealed: one the runtime role inserted is refused when read.
    """

    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="task_attempts")
    attempt = models.PositiveIntegerField()
    worker_id = models.CharField(max_length=200, blank=True, default="")
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    exception_class_path = models.CharField(max_length=500)
    traceback = models.TextField(blank=True, default="")
    #: HMAC under the evidence key over the row (``tasks.runs.attempt_text``): the
    #: runtime role may insert rows here, but a row it wrote is never shown as an
    #: error of the task (#35).
    seal = models.CharField(max_length=200, blank=True, default="", db_default="")

    class Meta:
        db_table = "k2b_task_attempt"
        ordering = ["run", "id"]

    def __str__(self) -> str:
        return f"{self.run_id} attempt {self.attempt}: {self.exception_class_path}"
