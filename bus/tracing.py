"""OpenTelemetry tracing over NATS headers (invariant 5 in docs/architecture.md:
one trace per prompt).

`setup` reads the standard env vars: with OTEL_EXPORTER_OTLP_ENDPOINT (or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) set, spans go out over OTLP/HTTP; otherwise tracing
stays a no-op. The W3C `traceparent` rides in each message's headers; spans follow the
OTel messaging conventions (`messaging.system=nats`, destination, message id) plus
`jetrl.*` attributes. Which spans each stage opens, and how they make one trace per prompt,
is in docs/architecture.md ("Traces and metrics").
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

tracer = trace.get_tracer("jetrl")


class SystemRandomIds(IdGenerator):
    """Trace and span ids from the OS's randomness.

    The SDK's default draws from Python's global `random`, which the trainer seeds for
    reproducibility: every run's trainer then made the same ids, and Jaeger merged the train
    steps of different runs into one trace.
    """

    _random = random.SystemRandom()

    def generate_span_id(self) -> int:
        return self._random.getrandbits(64) or 1  # 0 is the invalid id

    def generate_trace_id(self) -> int:
        return self._random.getrandbits(128) or 1

    def is_trace_id_random(self) -> bool:
        return True


def setup(service: str, instance: str | None = None) -> TracerProvider | None:
    """Install an OTLP/HTTP exporter when the environment asks for one; return the provider.

    `instance` (the worker id) becomes the resource's `service.instance.id`, so every span
    names the process that made it. A second call in one process (the producer attaches
    like a worker) returns the provider already installed: the global one can be set once.
    """
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current
    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    attributes = {"service.name": os.environ.get("OTEL_SERVICE_NAME", service)}
    if instance:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attributes), id_generator=SystemRandomIds())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


def enabled() -> bool:
    """True once an SDK TracerProvider is installed (by `setup`, or by a test)."""
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Write the current context's traceparent (and tracestate) into `headers`."""
    propagate.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> context.Context:
    return propagate.extract(dict(headers or {}))


def traceparent(span: Span | None = None) -> str:
    """The W3C traceparent of `span` (default: the current span), or '' outside a span."""
    headers: dict[str, str] = {}
    propagate.inject(headers, context=None if span is None else trace.set_span_in_context(span))
    return headers.get("traceparent", "")


def link_to(traceparents: list[str] | tuple[str, ...]) -> list[Link]:
    """Span links to the traces named by traceparent strings (batch assembly, train step)."""
    links = []
    for tp in traceparents:
        span_context = trace.get_current_span(extract({"traceparent": tp})).get_span_context()
        if span_context.is_valid:
            links.append(Link(span_context))
    return links


def _attributes(
    subject: str, message_id: str, attributes: Mapping[str, str | int | float] | None
) -> dict:
    return {
        "messaging.system": "nats",
        "messaging.destination.name": subject,
        "messaging.message.id": message_id,
        **(attributes or {}),
    }


def send_headers(
    subject: str,
    message_id: str,
    headers: dict[str, str],
    attributes: Mapping[str, str | int | float] | None = None,
) -> dict[str, str]:
    """`headers` plus the context of a PRODUCER span recorded for this one publish.

    Without an SDK the API's span would be a non-recording copy of its parent's ids, so
    the current context goes into the headers as it is, saving ~5 µs of a ~30 µs publish
    (ops.bench.bus); and an empty context (no span, no baggage) gives the propagators
    nothing to write, so they are not called (~1.5 µs).
    """
    if not enabled():
        return inject(headers) if context.get_current() else headers
    with tracer.start_as_current_span(
        f"send {subject}",
        kind=SpanKind.PRODUCER,
        attributes={
            **_attributes(subject, message_id, attributes),
            "messaging.operation.name": "send",
        },
    ):
        return inject(headers)


@contextmanager
def spans_in(
    name: str, parents: Sequence[tuple[context.Context, Mapping[str, str | int | float | bool]]]
) -> Iterator[list[Span]]:
    """One span in each parent's trace around one piece of work done for all of them at once.

    A batched generation serves prompts of many traces: each prompt's trace gets its own
    span, with its own attributes, timed by the shared work. An exception marks every span
    failed and goes on.
    """
    spans = [
        tracer.start_span(name, context=parent, attributes=attributes)
        for parent, attributes in parents
    ]
    try:
        yield spans
    except Exception as exc:
        for span in spans:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        for span in spans:
            span.end()


_NO_SPAN = nullcontext(trace.INVALID_SPAN)


def process_span(
    subject: str,
    message_id: str,
    headers: Mapping[str, str] | None,
    attributes: Mapping[str, str | int | float] | None = None,
) -> AbstractContextManager[Span]:
    """A CONSUMER span for handling one message, child of the trace in its headers.

    Without an SDK and without a traceparent to carry on there is nothing to record or
    propagate, and the no-op span's ~5 µs is skipped (see `send_headers`).
    """
    if not enabled() and not (headers and "traceparent" in headers):
        return _NO_SPAN
    return tracer.start_as_current_span(
        f"process {subject}",
        context=extract(headers),
        kind=SpanKind.CONSUMER,
        attributes={
            **_attributes(subject, message_id, attributes),
            "messaging.operation.name": "process",
        },
    )
