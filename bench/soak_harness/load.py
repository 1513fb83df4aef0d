"""What the soak starts: workflow runs, task calls and task schedules, through the chaos.

The failure this is built around: a start whose COMMIT lost its answer (a
restart, a terminated backend). The harness must neither count a start that
did not commit nor start it twice. Runs are started under idempotency keys
and simply started again; task calls have none, so each batch of enqueues
inserts its calls into ``soak_task_enqueued`` in the enqueue's own transaction
(``enqueue()`` writes on the caller's connection, in its transaction), and
after an error the harness reads back how far it got.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

#: The task schedules: id -> (effect, seconds between ticks). Every tick must run.
SCHEDULES = {"soak.tick.idempotent": ("idempotent", 2), "soak.tick.external": ("external", 3)}
#: The effect of task call ``n``: by turns.
EFFECTS = ("pure", "idempotent", "external")
#: The call numbers of the CPU-bound task (``crunch``) start here.
HOG_CALLS = 1_000_000


class Load:
    """Starts root runs and task calls up to a target, each at most once."""

    def __init__(self) -> None:
        self.started = 0  # root runs committed
        self.enqueued = 0  # task calls committed
        self.hogs = 0  # CPU-bound task calls committed

    def start_runs(self, upto: int) -> None:
        """Start runs ``started .. upto``; a lost commit is retried with the same keys."""
        from django.db import DatabaseError, InterfaceError, connection, transaction

        from bench.soak_app.workflows import MIX
        from k2b_workflows import start_workflow_run

        names = [name for name, weight in MIX.items() for _ in range(weight)]
        try:
            with transaction.atomic():
                for i in range(self.started, upto):
                    name = names[i % len(names)]
                    start_workflow_run(name, {"i": i}, idempotency_key=f"soak-{i}")
            self.started = upto
        except (DatabaseError, InterfaceError):
            connection.close()

    def enqueue_tasks(self, upto: int) -> None:
        """Enqueue task calls ``enqueued .. upto`` in one transaction: by turns pure,
        idempotent and external; of each effect, every other call by ``.enqueue()`` and
        the rest in one ``enqueue_many``."""
        from django.db import DatabaseError, InterfaceError, connection, transaction

        from bench.soak_app.tasks import TASKS
        from k2b_workflows.tasks import enqueue_many

        calls = range(self.enqueued, upto)
        try:
            with transaction.atomic():
                rows: list[tuple[int, str, str, str]] = []
                for effect, task in TASKS.items():
                    mine = [n for n in calls if EFFECTS[n % len(EFFECTS)] == effect]
                    alone = [n for n in mine if (n // len(EFFECTS)) % 2 == 0]
                    many = [n for n in mine if (n // len(EFFECTS)) % 2 == 1]
                    rows += [(n, task.enqueue(n).id, effect, "enqueue") for n in alone]
                    if many:
                        results = enqueue_many(task, [([n], {}) for n in many])
                        rows += [
                            (n, result.id, effect, "enqueue_many")
                            for n, result in zip(many, results, strict=True)
                        ]
                with connection.cursor() as cursor:
                    cursor.executemany(
                        "INSERT INTO soak_task_enqueued (call, run_id, effect, how)"
                        " VALUES (%s, %s, %s, %s)",
                        rows,
                    )
            self.enqueued = upto
        except (DatabaseError, InterfaceError):
            connection.close()
            self.enqueued = self._recorded(self.enqueued)

    def enqueue_hogs(self, upto: int, ms: int) -> None:
        """Enqueue CPU-bound calls ``hogs .. upto`` of ``crunch``, each holding its
        worker's GIL for ``ms`` (the starvation soak)."""
        from django.db import DatabaseError, InterfaceError, connection, transaction

        from bench.soak_app.tasks import crunch

        try:
            with transaction.atomic():
                rows = [
                    (HOG_CALLS + n, crunch.enqueue(HOG_CALLS + n, ms).id, "pure", "enqueue")
                    for n in range(self.hogs, upto)
                ]
                with connection.cursor() as cursor:
                    cursor.executemany(
                        "INSERT INTO soak_task_enqueued (call, run_id, effect, how)"
                        " VALUES (%s, %s, %s, %s)",
                        rows,
                    )
            self.hogs = upto
        except (DatabaseError, InterfaceError):
            connection.close()
            self.hogs = self._recorded(self.hogs, hogs=True)

    @staticmethod
    def _recorded(default: int, hogs: bool = False) -> int:
        """How many task calls committed (the lost answer may have been a commit)."""
        from django.db import DatabaseError, InterfaceError, connection

        where = f"call {'>=' if hogs else '<'} {HOG_CALLS}"
        try:
            with connection.cursor() as cursor:
                cursor.execute(
                    f"SELECT COALESCE(max(call) + 1, 0) FROM soak_task_enqueued WHERE {where}"
                )
                found = int(cursor.fetchone()[0])
        except (DatabaseError, InterfaceError):
            connection.close()
            return default
        return found - HOG_CALLS if hogs and found else found


def schedule_tasks() -> dict[str, float]:
    """Schedule a task of each of ``SCHEDULES``, every tick to run (``catch_up="all"``,
    ``overlap="allow"``). Returns id -> seconds between ticks, for the checks."""
    from bench.soak_app.tasks import TASKS
    from k2b_workflows import Schedule
    from k2b_workflows.tasks import schedule_task

    for schedule_id, (effect, seconds) in SCHEDULES.items():
        every = Schedule(every=dt.timedelta(seconds=seconds), catch_up="all", overlap="allow")
        schedule_task(schedule_id, TASKS[effect], every, args=[-1])
    return {schedule_id: float(seconds) for schedule_id, (_, seconds) in SCHEDULES.items()}


def pause_schedules(attempts: int = 120) -> bool:
    """Pause the task schedules (the load is over), trying again through a restart."""
    import time

    from django.db import DatabaseError, InterfaceError, connection

    from k2b_workflows.models import WorkflowSchedule

    for _ in range(attempts):
        try:
            for row in WorkflowSchedule.objects.filter(schedule_id__in=list(SCHEDULES)):
                row.paused = True
                row.save()
            return True
        except (DatabaseError, InterfaceError):
            connection.close()
            time.sleep(0.5)
    return False


def workers_up(pids: list[int]) -> int:
    """How many of the worker processes ``pids`` have registered (a heartbeat row, alive)."""
    from django.db import DatabaseError, InterfaceError, connection

    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(DISTINCT pid) FROM k2b_worker"
                " WHERE state = 'alive' AND pid = ANY(%s)",
                [pids],
            )
            return cursor.fetchone()[0]
    except (DatabaseError, InterfaceError):
        connection.close()
        return 0


def counts() -> Any:
    """Runs by status, or None while the database cannot be read."""
    from collections import Counter

    from django.db import DatabaseError, InterfaceError, connection

    from k2b_workflows.models import WorkflowRun

    try:
        return Counter(WorkflowRun.objects.values_list("status", flat=True))
    except (DatabaseError, InterfaceError):
        connection.close()
        return None
