from django.apps import AppConfig


class SoakConfig(AppConfig):
    name = "bench.soak_app"
    label = "k2b_soak"
    verbose_name = "k2b_workflows soak"
