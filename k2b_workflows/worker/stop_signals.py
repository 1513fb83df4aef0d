"""SIGTERM and SIGINT, acted on by a thread of their own instead of a signal handler.

A Python signal handler runs in the main thread between two bytecodes of whatever
that thread was doing. If it was inside ``threading.Event.set()`` or ``wait()``, the
handler's own ``Event.set()`` waits for a lock its own thread holds, forever; if it
was writing to stderr, the handler's write raises ``RuntimeError: reentrant call``
and the stop request is lost. Either way a worker told to stop keeps running (seen
as a thawed worker ignoring SIGTERM while every thread logged its reconnection).

So the main thread blocks both signals before the worker starts any thread (every
thread it starts inherits the mask), and a watcher thread takes them with
``sigtimedwait`` and calls back in ordinary thread context, where locks and I/O are
safe. Threads that existed before (a test runner's, say) still have the signals
unblocked: for them a handler that only appends to a deque (no lock, no I/O) is
installed, and the watcher drains it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: How often the watcher looks at signals caught by the fallback handler; also the
#: longest the end of ``stop_signals`` waits for the watcher to notice it is done.
_POLL_S = 0.05


class _Watcher(threading.Thread):
    def __init__(self, on_signal: Callable[[int], None]) -> None:
        super().__init__(name="k2b-signals", daemon=True)
        self.on_signal = on_signal
        self.caught: collections.deque[int] = collections.deque()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            info = signal.sigtimedwait(STOP_SIGNALS, _POLL_S)
            # When a SIGSTOP/SIGCONT interrupts the wait and the timeout then runs out,
            # CPython returns an uninitialised siginfo instead of None: check the number.
            if info is not None and info.si_signo in STOP_SIGNALS:
                self._deliver(info.si_signo)
            while self.caught:
                self._deliver(self.caught.popleft())

    def _deliver(self, signum: int) -> None:
        try:
            self.on_signal(signum)
        except Exception:
            # The watcher must outlive a failing callback: the next signal may be the
            # operator's second, forcing one.
            logger.exception("acting on signal %d failed", signum)

    def catch(self, signum: int, frame: object) -> None:
        """The fallback handler: signal-safe, because it only appends."""
        self.caught.append(signum)


@contextlib.contextmanager
def stop_signals(on_signal: Callable[[int], None]) -> Iterator[None]:
    """Call ``on_signal(signum)`` from a watcher thread for each SIGTERM/SIGINT received.

    Must be entered in the main thread before the threads it should cover start;
    the previous mask and handlers are restored on exit.
    """
    watcher = _Watcher(on_signal)
    previous_handlers = {sig: signal.signal(sig, watcher.catch) for sig in STOP_SIGNALS}
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    watcher.start()
    try:
        yield
    finally:
        watcher.done.set()
        watcher.join()
        # A signal that arrived after the watcher's last look is still pending or
        # caught: act on it before unblocking hands it to the default disposition.
        pending = signal.sigpending() & set(STOP_SIGNALS)
        for signum in pending:
            signal.sigwait({signum})
            on_signal(signum)
        while watcher.caught:
            on_signal(watcher.caught.popleft())
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
