"""The OpenTelemetry SDK as a deployment would configure it, exporting to a file.

A process whose settings see ``K2B_TEST_OTEL_FILE`` calls ``export_spans_to``:
every span is written as one JSON line when it ends (``SimpleSpanProcessor``:
synchronously, so a span that ended before a SIGKILL is on disk).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def export_spans_to(path: str) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    out = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the process's life
    provider = TracerProvider(resource=Resource.create({"service.name": "k2b-test"}))
    exporter = ConsoleSpanExporter(
        out=out, formatter=lambda span: json.dumps(json.loads(span.to_json())) + "\n"
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)


def read_spans(*paths: Path) -> list[dict[str, Any]]:
    """The spans exported to ``paths``, each with ``"file"`` naming where it came from."""
    spans = []
    for path in paths:
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    spans.append({**json.loads(line), "file": path.name})
    return spans
