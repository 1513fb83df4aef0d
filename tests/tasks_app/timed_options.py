"""The options of tests/tasks_app/timed.py's tasks, importable by settings (#49)."""

from __future__ import annotations

#: Seconds a slow call runs: well past ``TIMEOUT``, short for a test.
SLOW_S = 0.6
TIMEOUT = 0.2


def stop_after_two(exception, task_result):
    """A module-level backoff: no wait, and no third attempt."""
    return None if task_result.attempts >= 2 else 0


def backoff_that_raises(exception, task_result):
    raise RuntimeError("a bug in the backoff")


#: Each task's options, by name: on @task (Django 6.1, the backport), or the default
#: backend's OPTIONS["tasks"] (Django 6.0).
TIMED = {
    "bounded": {"effect": "pure", "max_attempts": 3, "backoff": 0},
    "stops": {"effect": "pure", "max_attempts": 5, "backoff": stop_after_two},
    "spaced": {"effect": "pure", "max_attempts": 3, "backoff": 60},
    "asked": {
        "effect": "idempotent",
        "max_attempts": 3,
        "backoff": lambda exception, task_result: 100 * task_result.attempts,
    },
    "buggy_backoff": {"effect": "pure", "max_attempts": 3, "backoff": backoff_that_raises},
    "slow_once": {"effect": "pure", "max_attempts": 2, "backoff": 0, "timeout": TIMEOUT},
    "always_slow": {"effect": "idempotent", "max_attempts": 2, "backoff": 0, "timeout": TIMEOUT},
    "slow_async": {"effect": "pure", "timeout": TIMEOUT},
    "slow_external": {"effect": "external", "max_attempts": 3, "backoff": 0, "timeout": TIMEOUT},
}
