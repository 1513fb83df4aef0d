"""How a worker process ends: what the interpreter does at exit, less what costs and serves nobody.

An interpreter that leaves ``main`` first joins its non-daemon threads, then runs
the ``atexit`` handlers (span exporters and coverage flush there, ``logging``
flushes its handlers), then tears down every module it imported, one object at
a time. For a process that imported Django, its apps and psycopg, the last part
took about 0.25 s on a 2-core machine: a quarter of an empty ``--burst``, paid by
every cron-started drain and by a supervisor's stop, and saving nothing (the
kernel's writes have committed or rolled back on the server long before).

``exit_now`` does the first two, flushes the streams, and ends the process
with ``os._exit``. A forked child must end that way anyway: returning would run
its parent's clean-up in the child.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading


def exit_hooks(*, join_threads: bool = True) -> None:
    """What an interpreter does at exit before its teardown: join the non-daemon
    threads (``join_threads``; as ``threading._shutdown`` does, and
    ``multiprocessing`` before its own ``os._exit``), run the ``atexit`` handlers,
    flush ``logging`` and the streams."""
    shutdown = getattr(threading, "_shutdown", None)
    in_main = threading.current_thread() is threading.main_thread()
    if join_threads and shutdown is not None and in_main:
        shutdown()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def exit_code(code: object) -> int:
    """The status ``sys.exit(code)`` gives: None is 0, an int is itself, anything
    else is printed to stderr (as the interpreter prints it) and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def exit_now(code: object = 0) -> None:
    """End the process with ``code`` (as given to ``sys.exit``) without the teardown."""
    status = exit_code(code)
    try:
        exit_hooks()
    finally:
        os._exit(status)
