"""Settings for the test suite: the example project plus the ``tests`` app."""

from example_project.settings import *  # noqa: F403
from example_project.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests", "docs.examples"]

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

# K2B_TEST_DIRECT_URL: DATABASE_URL goes through a transaction-pooling PgBouncer and
# this is the same database directly, the alias "direct" for LISTEN_DATABASE
# (docs/operations.md#pgbouncer); tests/worker/test_pgbouncer.py sets it.
if os.environ.get("K2B_TEST_DIRECT_URL"):
    from example_project.settings import _database_from_env

    DATABASES["direct"] = _database_from_env("K2B_TEST_DIRECT_URL")
    DATABASES["direct"]["NAME"] = DATABASES["default"]["NAME"]
    DATABASES["direct"]["TEST"] = {"MIRROR": "default"}
    K2B_WORKFLOWS = {**K2B_WORKFLOWS, "LISTEN_DATABASE": "direct"}

# K2B_TEST_PREPARE=0: the suite without prepared statements (Django's default,
# what a pooler needs), the kernel's hot statements in simple-protocol messages.
if os.environ.get("K2B_TEST_PREPARE") == "0":
    DATABASES["default"]["OPTIONS"]["prepare_threshold"] = None

# A worker subprocess may be given other K2B_WORKFLOWS values (a JSON object),
# e.g. a long lease to tell a hand-back from an expiry.
if os.environ.get("K2B_TEST_SETTINGS"):
    import json

    K2B_WORKFLOWS = {**K2B_WORKFLOWS, **json.loads(os.environ["K2B_TEST_SETTINGS"])}

# K2B_TEST_OTEL_FILE: this process exports its spans, as JSON lines, to that file
# (tests/kernel/test_tracing.py); the OpenTelemetry SDK is in the test extra.
if os.environ.get("K2B_TEST_OTEL_FILE"):
    from tests.support.otel import export_spans_to

    export_spans_to(os.environ["K2B_TEST_OTEL_FILE"])

# On Django 6 the admin runs under a strict Content-Security-Policy, as
# Django's own admin tests do: an inline script or style in our templates
# would be refused by the browser, and the browser tests fail on that.
import django  # noqa: E402

if django.VERSION >= (6, 0):
    from django.utils.csp import CSP

    MIDDLEWARE = [*MIDDLEWARE, "django.middleware.csp.ContentSecurityPolicyMiddleware"]
    SECURE_CSP = {
        "default-src": [CSP.SELF],
        "script-src": [CSP.SELF],
        "style-src": [CSP.SELF],
        "img-src": [CSP.SELF, "data:"],
    }

# The suite connects as a superuser on purpose (it creates databases and roles);
# tests/misuse/test_roles.py connects as a real runtime role and checks W003 itself.
SILENCED_SYSTEM_CHECKS = ["k2b_workflows.W003"]

# django.tasks on the kernel (#37): tests/tasks_app/ holds the tasks.
import datetime as _dt  # noqa: E402

from k2b_workflows import Concurrency, Fairness, Retry, Unique  # noqa: E402
from tests.tasks_app.timed_options import TIMED  # noqa: E402

TASKS = {
    "default": {
        "BACKEND": "k2b_workflows.tasks.WorkflowsBackend",
        "QUEUES": ["default", "mail", "reports"],
        # Options for tasks "one does not own": by path, and for every task of a module.
        "OPTIONS": {
            "tasks": {
                "tests.tasks_app.tasks.charge_reconciled": {
                    "reconcile": "tests.tasks_app.tasks.was_charged"
                },
                "tests.tasks_app.tasks.picky": {
                    "effect": "pure",
                    "retry": Retry(
                        max_attempts=3,
                        backoff=0.01,
                        jitter=False,
                        on=(ConnectionError,),
                    ),
                },
                "tests.tasks_app.library.*": {"effect": "idempotent"},
                "tests.tasks_app.library.purge": {"effect": "pure"},
                # Django's proposed options, for Django 6.0's bare @task (#49).
                **{f"tests.tasks_app.timed.{name}": options for name, options in TIMED.items()},
                # tests/tasks_app/fair.py: calls take turns by tenant (#50).
                "tests.tasks_app.fair.*": {
                    "effect": "pure",
                    "fairness": Fairness(key="tenant_id", weights={"gold": 3}),
                },
                "tests.tasks_app.fair.any_keywords": {
                    "effect": "pure",
                    "fairness": Fairness(key="tenant_id"),
                },
                # tests/tasks_app/unique.py: by_settings here only; the others here for
                # Django 6.0, where @task takes no unique= (a declaration on a task wins).
                "tests.tasks_app.unique.by_settings": {
                    "unique": Unique(keys=("site_id",), replace=True)
                },
                **{
                    f"tests.tasks_app.unique.{name}": {"unique": declared}
                    for name, declared in {
                        "rebuild_index": Unique(keys=("site_id",)),
                        "recent": Unique(keys=("site_id",), period=_dt.timedelta(minutes=10)),
                        "kept": Unique(
                            keys=("site_id",), states=("ready", "running", "successful")
                        ),
                        "every_argument": Unique(),
                        "replaced": Unique(keys=("site_id",), replace=True),
                        "debounced": Unique(
                            keys=("site_id",),
                            debounce=_dt.timedelta(seconds=30),
                            max_wait=_dt.timedelta(minutes=2),
                        ),
                        "with_context": Unique(keys=("site_id",)),
                    }.items()
                },
            }
        },
    },
    # One alias per declaration: on Django 6.0 @task takes no effect= or retry=, and
    # tests/tasks_app/tasks.py puts each task on the alias that declares it.
    **{
        effect: {
            "BACKEND": "k2b_workflows.tasks.WorkflowsBackend",
            "QUEUES": [],
            "OPTIONS": {"effect": effect},
        }
        for effect in ("pure", "idempotent", "external")
    },
    "retrying": {
        "BACKEND": "k2b_workflows.tasks.WorkflowsBackend",
        "QUEUES": [],
        "OPTIONS": {"effect": "pure", "retry": Retry(max_attempts=3, backoff=0.01, jitter=False)},
    },
    "one_at_a_time": {
        "BACKEND": "k2b_workflows.tasks.WorkflowsBackend",
        "QUEUES": [],
        "OPTIONS": {"effect": "pure", "concurrency": Concurrency(limit=1)},
    },
    # The budgeted tasks' declarations (tests/tasks_app/tasks.py, BUDGET and price).
    **{
        f"budgeted_{name}": {
            "BACKEND": "k2b_workflows.tasks.WorkflowsBackend",
            "QUEUES": [],
            "OPTIONS": {
                "effect": "idempotent" if name == "retrying" else name,
                "effect_budget": {"cents": 50_000},
                "cost": "tests.tasks_app.tasks.price",
                **(
                    {"retry": Retry(max_attempts=3, backoff=0.01, jitter=False)}
                    if name == "retrying"
                    else {}
                ),
            },
        }
        for name in ("external", "idempotent", "retrying")
    },
}
