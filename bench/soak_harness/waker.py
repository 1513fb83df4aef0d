"""The soak's waker process (``bench/soak.py --waker``): it opens the gates runs wait on.

The failure it is built around: a wake lost to the chaos. It wakes runs that
wait, and now and then a run that has not parked yet (the signal must not be
lost), and survives restarts and terminated sessions as any client should.
"""

from __future__ import annotations

import random
import signal
import time
from typing import Any


def waker() -> None:
    """Open the gates of waiting runs (and, now and then, of runs not parked yet).

    It survives the chaos like any client should: a database error closes the
    connection and the loop tries again; opening a gate and waking are idempotent.
    """
    import django

    django.setup()
    from django.db import DatabaseError, InterfaceError, connection, transaction

    from k2b_workflows import notify_workflow_worker, wake_workflow_runs_waiting_on

    rng = random.Random()
    stop = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    while not stop:
        try:
            with connection.cursor() as cursor:
                cursor.execute(
                    """SELECT wait_key FROM k2b_run
                        WHERE status = 'waiting' AND wait_kind = 'soak.gate'
                          AND waiting_since < now() - interval '200 milliseconds'
                        LIMIT 50"""
                )
                keys = [row[0] for row in cursor.fetchall()]
                if rng.random() < 0.3:  # a wake before the park: the signal must not be lost
                    cursor.execute(
                        """SELECT 'gate-' || (input->>'i') FROM k2b_run
                            WHERE workflow_name = 'soak.wait' AND status IN ('queued', 'running')
                            ORDER BY random() LIMIT 1"""
                    )
                    keys += [row[0] for row in cursor.fetchall()]
            for key in keys:
                with transaction.atomic():
                    with connection.cursor() as cursor:
                        cursor.execute(
                            "INSERT INTO soak_gate (key) VALUES (%s) ON CONFLICT DO NOTHING", [key]
                        )
                    wake_workflow_runs_waiting_on(app_id="soak", kind="soak.gate", key=key)
                    notify_workflow_worker("soak")
        except (DatabaseError, InterfaceError) as exc:
            print(f"waker: {type(exc).__name__}: {str(exc).strip()}; retrying", flush=True)
            connection.close()
            time.sleep(0.5)
        time.sleep(0.2)
