"""Liveness for supervisors: a file the worker loop touches, and the check of its age.

A process can be running and still useless: stuck in a loop that never
reaches the database, deadlocked, or failing every iteration. ``runworkflows
--health-file PATH`` touches PATH after every loop iteration that reached the
database and claimed what it could; ``manage.py workerhealth PATH
--max-age S`` exits 1 when the file is older than S seconds (or missing), so
a Kubernetes liveness probe or a systemd watchdog restarts the process.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

#: Touch at most this often: the loop may iterate thousands of times a second.
TOUCH_INTERVAL_S = 1.0


class HealthFile:
    """Touched by the worker loop after each healthy iteration (at most once a second)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._last = 0.0

    def touch(self) -> None:
        now = time.monotonic()
        if now - self._last < TOUCH_INTERVAL_S:
            return
        self._last = now
        self.path.touch()

    def remove(self) -> None:
        """At a clean stop: a stopped worker is not healthy, and must not look it."""
        self.path.unlink(missing_ok=True)


def age_s(path: str | os.PathLike[str]) -> float | None:
    """Seconds since ``path`` was last touched; None when it does not exist."""
    try:
        return max(time.time() - Path(path).stat().st_mtime, 0.0)
    except FileNotFoundError:
        return None
