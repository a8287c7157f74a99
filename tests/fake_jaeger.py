"""A stand-in for Jaeger all-in-one, stdlib only: OTLP/HTTP in, Jaeger's query API out.

    POST /v1/traces            OTLP/HTTP protobuf spans (what the workers export)
    POST /v1/metrics           OTLP/HTTP protobuf metrics (kept, by metric name)
    GET  /api/traces/{id}      {"data": [trace]}, or 404
    GET  /api/traces?service=S[&operation=O][&tags={"k":"v"}][&start=µs][&end=µs][&limit=N]
                               {"data": [trace, ...]}: traces with a span of service S
                               (and operation O) whose tags hold every k=v, compared as strings

A trace is Jaeger's JSON: `traceID`, `spans` (traceID, spanID, operationName, references,
startTime and duration in µs, tags, logs, processID) and `processes` (serviceName, tags).
Spans are translated the way Jaeger does it (opentelemetry-collector-contrib
pkg/translator/jaeger): the parent becomes the first reference, CHILD_OF; each link a
FOLLOWS_FROM reference; the kind a `span.kind` tag (none for internal); an error status
the tags `otel.status_code` and `error`; resource attributes the process tags.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections import Counter
from typing import Any
from urllib.parse import parse_qs, urlparse

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

KINDS = {
    Span.SPAN_KIND_SERVER: "server",
    Span.SPAN_KIND_CLIENT: "client",
    Span.SPAN_KIND_PRODUCER: "producer",
    Span.SPAN_KIND_CONSUMER: "consumer",
}


def _tag(key: str, value: AnyValue) -> dict[str, Any]:
    kind = value.WhichOneof("value")
    if kind == "bool_value":
        return {"key": key, "type": "bool", "value": value.bool_value}
    if kind == "int_value":
        return {"key": key, "type": "int64", "value": value.int_value}
    if kind == "double_value":
        return {"key": key, "type": "float64", "value": value.double_value}
    return {"key": key, "type": "string", "value": value.string_value}


def _tags(attributes: list[KeyValue]) -> list[dict[str, Any]]:
    return [_tag(a.key, a.value) for a in attributes]


def _as_string(value: Any) -> str:
    """A tag value as Jaeger's storage compares it to a query's: booleans lower-case."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _jaeger_span(span: Span) -> dict[str, Any]:
    trace_id = span.trace_id.hex()
    references = []
    if span.parent_span_id:
        references.append(
            {"refType": "CHILD_OF", "traceID": trace_id, "spanID": span.parent_span_id.hex()}
        )
    references += [
        {"refType": "FOLLOWS_FROM", "traceID": link.trace_id.hex(), "spanID": link.span_id.hex()}
        for link in span.links
    ]
    tags = _tags(list(span.attributes))
    if span.kind in KINDS:
        tags.append({"key": "span.kind", "type": "string", "value": KINDS[span.kind]})
    if span.status.code == Status.STATUS_CODE_ERROR:
        tags += [
            {"key": "otel.status_code", "type": "string", "value": "ERROR"},
            {"key": "error", "type": "bool", "value": True},
        ]
    return {
        "traceID": trace_id,
        "spanID": span.span_id.hex(),
        "flags": 1,
        "operationName": span.name,
        "references": references,
        "startTime": span.start_time_unix_nano // 1000,
        "duration": (span.end_time_unix_nano - span.start_time_unix_nano) // 1000,
        "tags": tags,
        "logs": [
            {
                "timestamp": e.time_unix_nano // 1000,
                "fields": [
                    {"key": "event", "type": "string", "value": e.name},
                    *_tags(list(e.attributes)),
                ],
            }
            for e in span.events
        ],
        "warnings": None,
    }


class FakeJaeger:
    """The server and what it has received. Use as a context manager; `url` is its base URL."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], dict[str, Any]]] = []
        """(Jaeger span, its process) in arrival order."""
        self.metric_points: Counter[str] = Counter()
        """Data points received per metric name over OTLP."""
        self.lock = threading.Lock()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeJaeger:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    # Ingest -------------------------------------------------------------------------------
    def add_traces(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        with self.lock:
            for resource_spans in request.resource_spans:
                attributes = list(resource_spans.resource.attributes)
                service = next(
                    (a.value.string_value for a in attributes if a.key == "service.name"), "unknown"
                )
                process = {
                    "serviceName": service,
                    "tags": _tags([a for a in attributes if a.key != "service.name"]),
                }
                for scope_spans in resource_spans.scope_spans:
                    self.spans += [(_jaeger_span(span), process) for span in scope_spans.spans]

    def add_metrics(self, body: bytes) -> None:
        request = ExportMetricsServiceRequest()
        request.ParseFromString(body)
        with self.lock:
            for resource_metrics in request.resource_metrics:
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        points = getattr(metric, metric.WhichOneof("data")).data_points
                        self.metric_points[metric.name] += len(points)

    # Query --------------------------------------------------------------------------------
    def trace(self, trace_id: str) -> dict[str, Any] | None:
        """One trace in Jaeger's JSON, with a process id per distinct process."""
        with self.lock:
            members = [
                (span, process) for span, process in self.spans if span["traceID"] == trace_id
            ]
        if not members:
            return None
        processes: dict[str, dict[str, Any]] = {}
        spans = []
        for span, process in members:
            pid = next(
                (key for key, known in processes.items() if known == process),
                f"p{len(processes) + 1}",
            )
            processes[pid] = process
            spans.append({**span, "processID": pid})
        return {"traceID": trace_id, "spans": spans, "processes": processes, "warnings": None}

    def search(self, query: dict[str, list[str]]) -> list[dict[str, Any]]:
        """The traces a Jaeger search with these query parameters returns."""
        service = query["service"][0]
        operation = query.get("operation", [""])[0]
        wanted = {k: str(v) for tags in query.get("tags", []) for k, v in json.loads(tags).items()}
        start = int(query.get("start", ["0"])[0])
        end = int(query.get("end", [str(1 << 62)])[0])
        limit = int(query.get("limit", ["100"])[0])

        def matches(span: dict[str, Any], process: dict[str, Any]) -> bool:
            tags = {t["key"]: _as_string(t["value"]) for t in [*span["tags"], *process["tags"]]}
            return (
                process["serviceName"] == service
                and operation in ("", span["operationName"])
                and start <= span["startTime"] <= end
                and all(tags.get(k) == v for k, v in wanted.items())
            )

        with self.lock:
            ids = list(
                dict.fromkeys(
                    span["traceID"] for span, process in self.spans if matches(span, process)
                )
            )
        return [trace for trace_id in ids[:limit] if (trace := self.trace(trace_id)) is not None]

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        jaeger = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/v1/traces":
                    jaeger.add_traces(body)
                elif self.path == "/v1/metrics":
                    jaeger.add_metrics(body)
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802
                url = urlparse(self.path)
                if url.path.startswith("/api/traces/"):
                    trace = jaeger.trace(url.path.rsplit("/", 1)[1])
                    if trace is None:
                        self.reply(
                            404, {"data": None, "errors": [{"code": 404, "msg": "trace not found"}]}
                        )
                    else:
                        self.reply(200, {"data": [trace], "errors": None})
                elif url.path == "/api/traces":
                    query = parse_qs(url.query)
                    if "service" not in query:
                        error = {"code": 400, "msg": "parameter 'service' is required"}
                        self.reply(400, {"data": None, "errors": [error]})
                    else:
                        self.reply(200, {"data": jaeger.search(query), "errors": None})
                else:
                    self.send_error(404)

            def reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        return Handler
