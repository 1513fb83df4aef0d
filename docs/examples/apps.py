from django.apps import AppConfig


class DocsExamplesConfig(AppConfig):
    name = "docs.examples"
    label = "docs_examples"
    verbose_name = "Documentation examples"
    default_auto_field = "django.db.models.BigAutoField"
