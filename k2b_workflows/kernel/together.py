"""Pure ends committed together: one transaction for the ends of several runs.

A no-op task's end is one statement, and its commit (the round trip, the
transaction, the WAL flush) costs the server as much as the statement itself:
a quarter of a drained task's server CPU went to the commit alone. Pure work
may wait for the next write (DESIGN.md, "Performance budget": a PURE step's
success rides on the next write; after a crash it runs again), so the ends
that write nothing but pure work (a pure task's, a run's whose last steps are
PURE) may wait for each other when one worker thread runs them one after
another, and commit as one transaction.

How: the run whose end is ready hands its statements to ``EndsTogether.commit``,
which runs the next run the worker has claimed right there, in the same thread,
if that run may join (``may_join``, and the runner's ``join``: a run of the same
workflow or task, while the batch is small and young and the run before was
quick). Its end joins the same list if it is pure too (``RunEnding``; an
effect's end commits alone), and so on; the last one to join sends every
statement in one round trip (``db.commit_batch``), and each run takes its own
rows back as the stack unwinds, going on with its end exactly as after a
commit of its own: its journal entries stored, its signal sent, its witness
line told, its statistics counted. Nothing is visible to anyone before the
commit, so nothing said "succeeded" about an end that did not commit.

- A statement that matched no row (the run was canceled, or taken over, while
  it waited) makes the batch refused, as it would make a run's own end: the
  batch rolls back and each run ends again on its own, as after a refused end
  of its own. A commit whose answer was lost is each run's unknown commit
  outcome, handled as any other.
- A worker killed before the commit loses those ends; the runs are taken over
  when their leases run out and run again, as PURE work does after any crash.
  A run whose end committed never runs again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from . import db

#: The most ``PURE_ENDS_TOGETHER`` may be (a system check says so): each run that
#: joins executes inside the end before it, nine frames deeper on the thread's stack.
MAX_ENDS = 64
#: No run joins once the first end has waited this long (seconds).
MAX_WAIT = 0.02
#: Nor after a run whose own execution took longer than this (seconds): the next
#: run of the same workflow or task is likely to take as long, and every end before
#: it waits.
QUICK = 0.005


class EndsTogether:
    """The ends of pure runs one worker thread executes one after another, committed as one.

    ``join`` is called when an end is ready and may run the next claimed run (in
    this thread, its end joining this list); it returns False when no run may
    join. The runner supplies it: which runs are claimed is its business.
    """

    def __init__(self, using: str, join: Callable[[EndsTogether], bool], *, max_ends: int) -> None:
        self.using = using
        #: At most this many ends in one commit (``PURE_ENDS_TOGETHER``): a run's
        #: end waits for at most this many runs after it, and each one that joins adds
        #: its frames to the thread's stack.
        self.max_ends = max_ends
        self._join = join
        self._statements: list[db.Statement] = []
        self._rows: list[tuple | None] = []
        self._error: Exception | None = None
        self._sent = False
        #: ``time.monotonic()`` when the first end joined, and when the run now
        #: executing started (set by the runner before each one).
        self.first_end = 0.0
        self.run_started = time.monotonic()
        #: Runs whose ends joined, the first included.
        self.ends = 0
        #: Seconds the runs that joined took, as the runner counts them (``Runner._join``).
        self.joined_seconds = 0.0

    def may_join(self) -> bool:
        """Whether one more run may execute before the commit: the batch is not full,
        its first end has not waited too long, and the run whose end just joined was
        quick."""
        now = time.monotonic()
        return (
            not self._sent
            and self.ends < self.max_ends
            and now - self.first_end < MAX_WAIT
            and now - self.run_started < QUICK
        )

    def commit(self, statements: Sequence[db.Statement]) -> list[tuple | None]:
        """Commit ``statements`` with the ends of the runs that join; returns their rows.

        Called once by each run of the batch, always before the batch is sent: a
        run joins only while ``may_join`` says the batch is open, and its end
        calls this before it returns to the loop below. Raises what
        ``db.commit_batch`` raised for the whole batch (each run handles it as its
        own).
        """
        if not self.ends:
            self.first_end = time.monotonic()
        start = len(self._statements)
        self._statements.extend(statements)
        self.ends += 1
        while self.may_join() and self._join(self):
            pass
        if not self._sent:
            self._sent = True
            try:
                self._rows = db.commit_batch(self.using, self._statements)
            except Exception as exc:
                self._error = exc
        if self._error is not None:
            raise self._error
        return self._rows[start : start + len(statements)]
