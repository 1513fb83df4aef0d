from django.apps import AppConfig


class BenchConfig(AppConfig):
    name = "bench"
    label = "k2b_bench"
    verbose_name = "k2b_workflows benchmarks"
