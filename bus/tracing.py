"""OpenTelemetry tracing over NATS headers (DESIGN invariant 5: one trace per prompt).

`setup` reads the standard env vars: with OTEL_EXPORTER_OTLP_ENDPOINT (or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) set, spans go out over OTLP/HTTP; otherwise tracing
stays a no-op. The W3C `traceparent` rides in each message's headers; spans follow the
OTel messaging conventions (`messaging.system=nats`, destination, message id) plus
`jetrl.*` attributes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link, Span, SpanKind

tracer = trace.get_tracer("jetrl")


def setup(service: str) -> TracerProvider | None:
    """Install an OTLP/HTTP exporter when the environment asks for one; return the provider."""
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    name = os.environ.get("OTEL_SERVICE_NAME", service)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Write the current context's traceparent (and tracestate) into `headers`."""
    propagate.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> context.Context:
    return propagate.extract(dict(headers or {}))


def traceparent() -> str:
    """The current context's W3C traceparent, or '' outside a span."""
    return inject({}).get("traceparent", "")


def link_to(traceparents: list[str] | tuple[str, ...]) -> list[Link]:
    """Span links to the traces named by traceparent strings (batch assembly, train step)."""
    links = []
    for tp in traceparents:
        span_context = trace.get_current_span(extract({"traceparent": tp})).get_span_context()
        if span_context.is_valid:
            links.append(Link(span_context))
    return links


def _attributes(subject: str, message_id: str, attributes: Mapping[str, str | int | float] | None) -> dict:
    return {
        "messaging.system": "nats",
        "messaging.destination.name": subject,
        "messaging.message.id": message_id,
        **(attributes or {}),
    }


@contextmanager
def send_span(subject: str, message_id: str, attributes: Mapping[str, str | int | float] | None = None) -> Iterator[Span]:
    """A PRODUCER span around one publish; its context is what `inject` puts in the headers."""
    with tracer.start_as_current_span(
        f"send {subject}",
        kind=SpanKind.PRODUCER,
        attributes={**_attributes(subject, message_id, attributes), "messaging.operation.name": "send"},
    ) as span:
        yield span


@contextmanager
def process_span(
    subject: str,
    message_id: str,
    headers: Mapping[str, str] | None,
    attributes: Mapping[str, str | int | float] | None = None,
) -> Iterator[Span]:
    """A CONSUMER span for handling one message, child of the trace in its headers."""
    with tracer.start_as_current_span(
        f"process {subject}",
        context=extract(headers),
        kind=SpanKind.CONSUMER,
        attributes={**_attributes(subject, message_id, attributes), "messaging.operation.name": "process"},
    ) as span:
        yield span
