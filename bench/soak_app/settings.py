"""Settings for the soak's processes: the example project plus the soak's app.

``DATABASE_URL`` points at the cluster ``bench/soak.py`` started (a unix socket
in a temporary directory). Timings are short so that a frozen worker's lease
expires and crashed runs are retried within seconds; ``K2B_SOAK_LEASE_MS`` sets
the lease (the harness passes its ``--lease-ms``; the starvation soak a short one).
"""

import os

from example_project.settings import *  # noqa: F403
from example_project.settings import DATABASES, INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "bench.soak_app.apps.SoakConfig"]

#: The EXTERNAL provider records its calls through a connection of its own: a
#: provider is another system, its writes never share the kernel's transactions.
DATABASES["provider"] = {**DATABASES["default"]}

#: One alias per effect: ``bench/soak_app/tasks.py`` puts each task on its own, which
#: Django 6.0's ``@task`` (no ``effect=``), 6.1's and the backport's all accept.
TASKS = {
    effect: {
        "BACKEND": "k2b_workflows.tasks.WorkflowsBackend",
        "QUEUES": [],
        "OPTIONS": {"effect": effect},
    }
    for effect in ("pure", "idempotent", "external")
}
TASKS["default"] = TASKS["external"]

K2B_WORKFLOWS = {
    "RUN_LEASE_MS": int(os.environ.get("K2B_SOAK_LEASE_MS", "3000")),
    "POLL_INTERVAL_MS": 500,
    "RETRY_BACKOFF_MS": 100,
    "RETRY_BACKOFF_MAX_MS": 2000,
    # Every crash (a killed worker, a restart under a step) counts as a failure in a
    # row; the soak crashes often on purpose and must not exhaust its runs' retries.
    "RUN_MAX_CONSECUTIVE_FAILURES": 25,
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"line": {"format": "%(asctime)s %(process)d %(levelname)s %(message)s"}},
    "handlers": {"stdout": {"class": "logging.StreamHandler", "formatter": "line"}},
    "root": {"handlers": ["stdout"], "level": "WARNING"},
}
