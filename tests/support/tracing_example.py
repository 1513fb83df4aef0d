"""docs/examples/tracing.py, run by tests/docs/test_docs_examples.py in a process of its own.

A tracer provider is global to a process: configured in the suite's, it would trace
every later test.

Configures tracing as docs/tracing.md does, starts a checkout under a request's
span, runs it to the end and prints what was exported, as one JSON line.
"""

import json

import django

django.setup()

from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

from docs.examples import getting_started, tracing  # noqa: E402, F401
from k2b_workflows.testing import run_until_idle  # noqa: E402

exporter = InMemorySpanExporter()
tracing.configure_tracing(exporter)
run = tracing.place_order("TEA-01", 2900)
run_until_idle()
trace.get_tracer_provider().force_flush()
print(
    json.dumps(
        [
            {
                "name": span.name,
                "trace_id": span.context.trace_id,
                "parent": span.parent.span_id if span.parent else None,
                "span_id": span.context.span_id,
                "attributes": dict(span.attributes),
            }
            for span in exporter.get_finished_spans()
        ]
    )
)
