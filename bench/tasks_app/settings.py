"""Settings of the django.tasks comparison: the bench's database, and ``TASKS`` from
``K2B_BENCH_TASKS``: ``k2b`` (k2b_workflows' backend; its tasks' effect is
``K2B_BENCH_EFFECT``, pure if unset) or ``db`` (django-tasks-db's
``DatabaseBackend``, its app installed)."""

import os

from bench.settings import *  # noqa: F403
from bench.settings import INSTALLED_APPS

if os.environ.get("K2B_BENCH_TASKS") == "db":
    INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks_db"]
    try:
        import django.tasks  # noqa: F401
    except ImportError:  # Django 5.2: the backport's app too
        INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks"]
    TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
else:
    TASKS = {
        "default": {
            "BACKEND": "k2b_workflows.tasks.WorkflowsBackend",
            "OPTIONS": {"effect": os.environ.get("K2B_BENCH_EFFECT", "pure")},
        }
    }
