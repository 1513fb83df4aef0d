"""Settings for benchmark processes: the example project on the benchmark's own database.

``bench/run.py`` creates the database named by ``K2B_BENCH_DB`` on the server of
``DATABASE_URL`` and drops it afterwards. The kernel's own defaults apply
(lease, poll interval): the numbers are what a deployment would see.
"""

import os

from example_project.settings import *  # noqa: F403
from example_project.settings import DATABASES, INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "bench.apps.BenchConfig"]
DATABASES["default"]["NAME"] = os.environ["K2B_BENCH_DB"]
K2B_WORKFLOWS = {"POLL_INTERVAL_MS": 1000}
# As deployed: with DEBUG every query is also recorded in ``connection.queries``.
DEBUG = False
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "root": {"handlers": [], "level": "WARNING"},
}
