"""The worker process: what ``manage.py runworkflows`` runs. No user code imports it.

``loop`` holds ``Worker`` (starting, the claim loop, shutting down; what it is
started with is one ``WorkerOptions``: ``options``), and the
parts that hold its state below it: the runs it claimed and hands back
(``claims``), what its pool threads do (``runner``), its periodic passes,
housekeeping and schedules (``housekeeping``), and which runs it takes
(``selection``). Beside them, what only a worker process needs: its threads' database connections
(``connections``), its status line (``status``), its start-up checks (``startup``), the LISTEN
that wakes it (``wakeups``), the signals that stop it (``stop_signals``), how it
exits (``exits``), the supervisor of ``--processes`` (``supervisor``), its
liveness file (``health``), how far ahead it claims (``prefetch``), workflow
timeouts (``timeouts``), the database's topology (``topology``) and its log
format (``logformat``). The kernel below never imports any of it.

``Worker`` resolves on first access (PEP 562): the supervisor imports
``worker.exits`` before it forks and must not pay for the whole loop.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .loop import Worker, WorkerOptions, default_status_stream

__all__ = ["Worker", "WorkerOptions", "default_status_stream"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.loop"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
