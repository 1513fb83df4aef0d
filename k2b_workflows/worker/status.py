"""The one-line live status a worker shows on a terminal."""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import TextIO


class StatusLine:
    """Redrawn at most once a second on a TTY; without one, printed once at the end."""

    def __init__(self, worker_id: str, concurrency: int) -> None:
        self.worker_id = worker_id
        self.concurrency = concurrency
        self._last = 0.0

    def show(
        self, stream: TextIO | None, stats: Counter[str], busy: int, *, final: bool = False
    ) -> None:
        if stream is None:
            return
        now = time.monotonic()
        if not final and now - self._last < 1.0:
            return
        self._last = now
        s = stats
        line = (
            f"k2b worker {self.worker_id}: busy {busy}/{self.concurrency} · runs {s['runs']} · "
            f"steps {s['steps']} · succeeded {s['succeeded']} · failed {s['failed']} · "
            f"waiting {s['waiting']} · attention {s['needs_attention']} · retries {s['retry']}"
        )
        tty = getattr(stream, "isatty", lambda: False)()
        if tty:
            stream.write("\r\x1b[2K" + line + ("\n" if final else ""))
        elif final:
            stream.write(line + "\n")
        stream.flush()


def default_status_stream() -> TextIO | None:
    return sys.stdout if sys.stdout.isatty() else None
