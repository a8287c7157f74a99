"""One trace across publish and consume: in memory, and over OTLP/HTTP to a real receiver."""

from __future__ import annotations

import asyncio
import http.server
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from bus.embedded import EmbeddedNats
from bus.topology import Topology
from bus.tracing import SystemRandomIds
from tests.traced_chain import chain

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def spans() -> InMemorySpanExporter:
    """The process-wide tracer provider can be set once: one in-memory exporter per session."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


def test_publish_consume_chain_is_one_trace(
    nats_server: EmbeddedNats, topology: Topology, spans: InMemorySpanExporter
) -> None:
    spans.clear()
    asyncio.run(chain(nats_server.url, topology.run))
    by_name = {
        s.name: s
        for s in spans.get_finished_spans()
        if topology.run in s.name or s.name == "prompt"
    }
    root = by_name["prompt"]
    send_traj = by_name[f"send rl.{topology.run}.trajectories"]
    process_traj = by_name[f"process rl.{topology.run}.trajectories"]
    send_reward = by_name[f"send rl.{topology.run}.rewards"]
    process_reward = by_name[f"process rl.{topology.run}.rewards"]
    assert {s.context.trace_id for s in by_name.values()} == {root.context.trace_id}
    assert send_traj.parent and process_traj.parent and send_reward.parent and process_reward.parent
    assert root.context and send_traj.context and process_traj.context and send_reward.context
    assert process_traj.attributes is not None
    assert send_traj.parent.span_id == root.context.span_id
    assert process_traj.parent.span_id == send_traj.context.span_id
    assert send_reward.parent.span_id == process_traj.context.span_id
    assert process_reward.parent.span_id == send_reward.context.span_id
    assert send_traj.kind == SpanKind.PRODUCER and process_traj.kind == SpanKind.CONSUMER
    assert process_traj.attributes["messaging.system"] == "nats"
    assert (
        process_traj.attributes["messaging.destination.name"] == f"rl.{topology.run}.trajectories"
    )
    assert process_traj.attributes["messaging.message.id"] == f"{topology.run}/0/0/0"
    assert process_traj.attributes["jetrl.run"] == topology.run


class _Receiver(http.server.BaseHTTPRequestHandler):
    received: list[ExportTraceServiceRequest] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf":
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            self.received.append(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def otlp_receiver() -> Iterator[str]:
    _Receiver.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_spans_reach_an_otlp_http_receiver(
    nats_server: EmbeddedNats, topology: Topology, otlp_receiver: str
) -> None:
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver,
        "OTEL_SERVICE_NAME": "jetrl-test",
    }
    subprocess.run(
        [sys.executable, "-m", "tests.traced_chain", nats_server.url, topology.run],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=60,
    )
    spans = [
        (span, rs.resource)
        for request in _Receiver.received
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]
    names = {span.name for span, _ in spans}
    assert {
        "prompt",
        f"send rl.{topology.run}.trajectories",
        f"process rl.{topology.run}.rewards",
    } <= names
    assert len({span.trace_id for span, _ in spans}) == 1
    service = {
        a.value.string_value for _, r in spans for a in r.attributes if a.key == "service.name"
    }
    assert service == {"jetrl-test"}


def test_trace_ids_do_not_follow_a_seeded_random() -> None:
    """The trainer seeds Python's `random`; with the SDK's default ids every run's train steps
    got the same trace ids, and Jaeger merged them across runs."""
    ids = set()
    for _ in range(2):
        random.seed(0)
        ids.add((SystemRandomIds().generate_trace_id(), SystemRandomIds().generate_span_id()))
    assert len(ids) == 2


WITHOUT_SDK = """
from opentelemetry import context
from bus import tracing

assert not tracing.enabled()
tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
token = context.attach(tracing.extract({"traceparent": tp}))
carried = tracing.send_headers("s", "id", {"Nats-Msg-Id": "id"})
context.detach(token)
assert carried.get("traceparent") == tp, carried
alone = tracing.send_headers("s", "id", {"Nats-Msg-Id": "id"})
assert alone == {"Nats-Msg-Id": "id"}, alone
"""


def test_without_an_sdk_a_publish_carries_the_trace_it_is_in_and_makes_none_up() -> None:
    """No SDK (a fresh process, no OTLP endpoint): a handler's publish inside the context of
    the message it handles carries that message's traceparent on, and a publish in no trace
    (where the propagators are skipped) gets no traceparent."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_SDK],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
