"""Settings for the test suite: the example project plus the ``tests`` app."""

from example_project.settings import *  # noqa: F403
from example_project.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests"]

# Short timings so that lease expiry, retries and polling happen quickly in tests.
K2B_WORKFLOWS = {
    "RUN_LEASE_MS": 2000,
    "RETRY_BACKOFF_MS": 50,
    "POLL_INTERVAL_MS": 200,
}

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# Worker subprocesses started by the crash tests connect to the test database.
import os  # noqa: E402

if os.environ.get("K2B_TEST_DB_NAME"):
    DATABASES["default"]["NAME"] = os.environ["K2B_TEST_DB_NAME"]
    DATABASES["default"].setdefault("TEST", {})["NAME"] = os.environ["K2B_TEST_DB_NAME"]
