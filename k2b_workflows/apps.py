from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate
from django.utils.module_loading import autodiscover_modules


class K2BWorkflowsConfig(AppConfig):
    name = "k2b_workflows"
    verbose_name = "Workflows"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
        from .redaction import install_log_filter

        # What the kernel logs is scrubbed like what it stores (secrets in URLs).
        install_log_filter()

        # Each installed app's ``workflows`` module defines its actions and
        # workflows, as ``admin.py`` modules register admin classes.
        autodiscover_modules("workflows")

        # ``migrate`` writes the decorators' schedules (and disables removed ones).
        post_migrate.connect(_sync_decorator_schedules, sender=self)


def _sync_decorator_schedules(sender: Any, **kwargs: Any) -> None:
    from .scheduling import post_migrate as sync

    sync(sender, **kwargs)
