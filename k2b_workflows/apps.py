from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.db.backends.signals import connection_created
from django.db.models.signals import post_migrate
from django.utils.module_loading import autodiscover_modules


class K2BWorkflowsConfig(AppConfig):
    name = "k2b_workflows"
    verbose_name = "Workflows"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
        from .kernel import schedule_seals
        from .models import schedules as schedule_models
        from .redaction import install_log_filter
        from .testdb import record_test_database, release_before_drop

        # Schedule rows are sealed under the evidence key, which only the kernel holds.
        schedule_models.sealer = schedule_seals

        # What the kernel logs is scrubbed like what it stores (secrets in URLs).
        install_log_filter()

        # The test runner migrates each test database it creates: those, and
        # only those, may be flushed past the append-only guards (testdb.py).
        post_migrate.connect(record_test_database, sender=self, dispatch_uid="k2b_test_db")
        # ... and drops each at the end, which the result listener's LISTEN
        # connection to it, left by a test that waited, made fail (testdb.py).
        connection_created.connect(release_before_drop, dispatch_uid="k2b_test_db_drop")

        # Each installed app's ``workflows`` module defines its actions and
        # workflows, as ``admin.py`` modules register admin classes.
        autodiscover_modules("workflows")

        # django.tasks: a process whose TASKS names our backend registers the task
        # workflows (tasks/runs.py), so its workers claim task runs (#37).
        if uses_task_backend():
            from .tasks import backend  # noqa: F401

        # ``migrate`` writes the decorators' schedules (and disables removed ones).
        post_migrate.connect(_sync_decorator_schedules, sender=self)


def uses_task_backend() -> bool:
    """Whether ``settings.TASKS`` has a ``k2b_workflows.tasks.WorkflowsBackend``."""
    configured = getattr(settings, "TASKS", None)
    if not isinstance(configured, dict):
        return False
    return any(
        isinstance(params, dict) and params.get("BACKEND") == "k2b_workflows.tasks.WorkflowsBackend"
        for params in configured.values()
    )


def _sync_decorator_schedules(sender: Any, **kwargs: Any) -> None:
    from .scheduling import post_migrate as sync

    sync(sender, **kwargs)
