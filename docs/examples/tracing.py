"""docs/tracing.md: the OpenTelemetry SDK configured once per process, and a traced start."""

# Each section shows its own imports.
# ruff: noqa: E402

# --8<-- [start:configure]
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter


def configure_tracing(exporter=None):
    """Call once per process: in the web app's and the workers' AppConfig.ready()."""
    provider = TracerProvider(resource=Resource.create({"service.name": "shop"}))
    # In production an OTLP exporter (opentelemetry-exporter-otlp) to your collector.
    provider.add_span_processor(BatchSpanProcessor(exporter or ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
# --8<-- [end:configure]


# --8<-- [start:start]
from k2b_workflows import start_workflow_run

tracer = trace.get_tracer("shop")


def place_order(sku, amount):
    # In a view instrumented by opentelemetry-instrumentation-django the request's
    # span is current already; this span stands in for it.
    with tracer.start_as_current_span("POST /orders"):
        return start_workflow_run("shop.checkout", {"sku": sku, "amount": amount})
# --8<-- [end:start]
