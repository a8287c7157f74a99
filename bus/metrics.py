"""OpenTelemetry metrics of every stage: throughput, latencies, rewards, staleness, queue depth.

`setup` reads the environment, like `tracing.setup`:

- OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_METRICS_ENDPOINT): metrics go out over
  OTLP/HTTP every OTEL_METRIC_EXPORT_INTERVAL ms (60 s by default), unless
  OTEL_METRICS_EXPORTER=none (for an endpoint that takes spans only, like Jaeger's).
- JETRL_PROMETHEUS_PORT=[HOST:]PORT: a Prometheus scrape endpoint (the `prometheus` extra),
  /metrics on HOST (default 0.0.0.0: the scraper runs elsewhere) at the first free port from PORT
  on. Several workers of one node share one setting that way (a fleet's workers inherit the
  fleet's environment); each logs the port it took, and its `target_info` series names it
  (`service_instance_id` = worker id).

Neither set: the instruments below are no-ops. They are created at import, through the
API's proxy meter, so a module records into them without knowing whether `setup` ran.

    jetrl.samples            counter    samples through a stage: stage, outcome
    jetrl.prompts            counter    prompts the producer issued
    jetrl.generate.duration  histogram  seconds of one batched generation call (rollout)
    jetrl.train_step.duration histogram seconds of one optimizer step (trainer)
    jetrl.reward             histogram  reward of each scored sample (reward worker)
    jetrl.staleness          histogram  steps between the version trained and the oldest
                                        version in a sample (trainer)
    jetrl.queue.depth        gauge      messages per work queue: queue, state (pending or
                                        in_flight), as the producer last read them
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from threading import Lock

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

log = logging.getLogger("jetrl.metrics")

PROMETHEUS_ENV = "JETRL_PROMETHEUS_PORT"
PORT_SCAN = 64
"""Ports tried from JETRL_PROMETHEUS_PORT on: more workers than this on one node is unlikely."""

SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# The SDK's default buckets (0, 5, 10, 25, ...) would put every reward in [0, 1] in one bucket.
REWARD_BUCKETS = (-1.0, -0.5, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 2.0, 5.0)
STALENESS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 8.0, 16.0, 32.0)

meter = metrics.get_meter("jetrl")

SAMPLES = meter.create_counter(
    "jetrl.samples",
    unit="{sample}",
    description="Samples through a stage, by stage (rollout, reward, buffer, trainer) and outcome "
    "(generated; scored or failed; batched or dropped; trained)",
)
PROMPTS = meter.create_counter(
    "jetrl.prompts", unit="{prompt}", description="Prompts issued by the producer"
)
GENERATE_SECONDS = meter.create_histogram(
    "jetrl.generate.duration",
    unit="s",
    description="One batched generation call of a rollout worker",
    explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
)
TRAIN_STEP_SECONDS = meter.create_histogram(
    "jetrl.train_step.duration",
    unit="s",
    description="One optimizer step of a trainer rank",
    explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
)
REWARD = meter.create_histogram(
    "jetrl.reward",
    description="Reward of each sample scored without failure",
    explicit_bucket_boundaries_advisory=REWARD_BUCKETS,
)
STALENESS = meter.create_histogram(
    "jetrl.staleness",
    unit="{step}",
    description="Per trained sample: the step training it minus the oldest weight version "
    "among its tokens",
    explicit_bucket_boundaries_advisory=STALENESS_BUCKETS,
)

_queue_depth: dict[tuple[str, str], int] = {}
_queue_depth_lock = Lock()


def set_queue_depth(queue: str, pending: int, in_flight: int) -> None:
    """Record what a work queue's consumer info said; the gauge reports the latest values.

    The gauge's callback runs on the exporter's (or the scrape's) thread and cannot await a
    consumer-info request, so the producer, which reads consumer info anyway, hands it over here.
    """
    with _queue_depth_lock:
        _queue_depth[(queue, "pending")] = pending
        _queue_depth[(queue, "in_flight")] = in_flight


def _observe_queue_depth(_options: CallbackOptions) -> Iterable[Observation]:
    with _queue_depth_lock:
        depths = list(_queue_depth.items())
    return [
        Observation(value, {"queue": queue, "state": state}) for (queue, state), value in depths
    ]


meter.create_observable_gauge(
    "jetrl.queue.depth",
    callbacks=[_observe_queue_depth],
    unit="{message}",
    description="Messages per work queue, pending (not yet delivered) or in flight (delivered, "
    "not acked)",
)


def count_samples(stage: str, outcome: str, n: int = 1) -> None:
    """`n` samples went through `stage` with `outcome`."""
    SAMPLES.add(n, {"stage": stage, "outcome": outcome})


def setup(service: str, instance: str | None = None) -> MeterProvider | None:
    """Install the exporters the environment asks for; return the provider (None: no-op).

    A second call in one process (the producer attaches like a worker) returns the first
    provider: the global one can be set once, and a second Prometheus server would take a
    second port.
    """
    current = metrics.get_meter_provider()
    if isinstance(current, MeterProvider):
        return current
    readers: list[MetricReader] = []
    otlp = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
    )
    if otlp and os.environ.get("OTEL_METRICS_EXPORTER") != "none":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if spec := os.environ.get(PROMETHEUS_ENV):
        readers.append(_prometheus(spec))
    if not readers:
        return None
    attributes = {"service.name": os.environ.get("OTEL_SERVICE_NAME", service)}
    if instance:
        attributes["service.instance.id"] = instance
    provider = MeterProvider(metric_readers=readers, resource=Resource.create(attributes))
    metrics.set_meter_provider(provider)
    return provider


def _prometheus(spec: str) -> MetricReader:
    """A Prometheus reader served at the first free port from `spec` ([HOST:]PORT)."""
    # Imported here: only workers asked for an endpoint need the exporter (an optional extra).
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server
    except ImportError as exc:
        raise ImportError(
            f"{PROMETHEUS_ENV} is set: pip install 'jetrl[prometheus]' ({exc})"
        ) from exc

    host, _, port_text = spec.rpartition(":")
    try:
        first = int(port_text)
    except ValueError:
        raise ValueError(f"{PROMETHEUS_ENV}={spec!r}: expected [HOST:]PORT") from None
    host = host or "0.0.0.0"
    for port in range(first, first + PORT_SCAN):
        try:
            start_http_server(port, host)
        except OSError:  # taken, most likely by another worker of this node
            continue
        log.info("Prometheus metrics on http://%s:%d/metrics", host, port)
        return PrometheusMetricReader()
    raise OSError(f"{PROMETHEUS_ENV}={spec}: no free port in {first}..{first + PORT_SCAN - 1}")
