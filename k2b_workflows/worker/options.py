"""``WorkerOptions``: what a worker is started with, in one value.

``runworkflows`` reads them from its command line once and hands each worker
(alone, or every child of a supervisor with its own health file) the same
value, so an option added here reaches every way a worker starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO


@dataclass(frozen=True)
class WorkerOptions:
    """A worker's options (``Worker(options)`` or ``Worker(**fields)``)."""

    #: ``--app``: only runs of these apps' workflows (None: every app).
    app_ids: Sequence[str] | None = None
    #: Pool threads: runs executed at once.
    concurrency: int = 1
    #: Exit once nothing is left to claim.
    burst: bool = False
    #: The database alias (None: the ``DATABASE`` setting).
    using: str | None = None
    #: This process's name in the fleet table (None: host, pid and a random part).
    worker_id: str | None = None
    #: Wake on LISTEN/NOTIFY, not only by polling.
    listen: bool = True
    #: Where the live status line is written (None: nowhere).
    status_stream: TextIO | None = None
    #: At start-up, give up after this many seconds without a database (None: never).
    wait_for_db: float | None = None
    #: Where start-up notices go ("waiting for the database"), besides the log.
    notice_stream: TextIO | None = None
    #: A file kept fresh while the worker is healthy.
    health_file: str | None = None
    #: Serve Prometheus metrics on this port.
    metrics_port: int | None = None
    #: Run schedule passes (``--no-schedules``: False).
    schedules: bool = True
    #: ``--queue``: only task runs of these django.tasks queues (None: every run).
    queues: Sequence[str] | None = None
