"""How many runs a worker's claim takes beyond its free threads.

A claim costs a commit and a read of the runs' journals; taking a few runs ahead
lets a thread that finishes one start the next without waiting for it. How far
ahead is a trade: each prefetched run waits in this worker's queue, leased to
it, while another worker may be idle. ``CLAIM_PREFETCH`` is the floor; on a
backlog of short runs the prefetch grows, bounded by time rather than by count,
so that it never holds more than ``HORIZON_S`` of its threads' work ahead.
"""

from __future__ import annotations

#: At the observed run time, how much work a worker may hold beyond the runs its
#: threads are executing: how long a run it took ahead can wait for a thread.
HORIZON_S = 0.1
#: And never more runs ahead than this, however short they are (a claim's read).
MAX_AHEAD = 64
#: Weight of the newest run in the running mean of a run's duration.
_SMOOTHING = 0.2


class Prefetch:
    """The number of runs to claim ahead (``current``), adapted to the backlog.

    While claims come back full (the queue holds more than was asked for) the
    prefetch doubles, up to what the threads get through in ``HORIZON_S`` at
    the mean run duration; a claim that comes back short (the backlog is gone)
    sets it back to the floor. Runs of a second or more are therefore never
    taken ahead beyond the floor, and a floor of 0 (no prefetch) stays 0.
    """

    def __init__(self, floor: int, concurrency: int) -> None:
        self.floor = floor
        self.concurrency = concurrency
        self.current = floor
        #: Running mean of one run's wall time on a thread (None: none ran yet).
        self.run_s: float | None = None

    def ran(self, seconds: float) -> None:
        """A thread finished executing a run (whatever its outcome) in ``seconds``."""
        if self.run_s is None:
            self.run_s = seconds
        else:
            self.run_s += _SMOOTHING * (seconds - self.run_s)

    def claimed(self, asked: int, got: int) -> None:
        """A claim asked for ``asked`` runs and got ``got``."""
        if got < asked or self.floor == 0:
            self.current = self.floor
        else:
            self.current = min(self.current * 2, self.ceiling())

    def ceiling(self) -> int:
        """The most runs ahead the threads get through in ``HORIZON_S``; at least the floor."""
        if self.run_s is None or self.run_s <= 0:
            return self.floor
        ahead = int(HORIZON_S * self.concurrency / self.run_s)
        return max(self.floor, min(ahead, MAX_AHEAD))
