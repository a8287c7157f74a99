"""Metrics on a Prometheus scrape endpoint: the port scan, the instruments, the queue gauge."""

from __future__ import annotations

import logging
import re
import socket
import urllib.request

import pytest
from opentelemetry import metrics as otel_metrics
from opentelemetry.sdk.metrics import MeterProvider

from bus import metrics


def test_prometheus_endpoint_serves_the_counters(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if isinstance(otel_metrics.get_meter_provider(), MeterProvider):
        pytest.skip("this process already has a meter provider (OTEL_EXPORTER_OTLP_ENDPOINT set?)")
    with socket.socket() as taken:  # another worker of the node holds the first port
        taken.bind(("127.0.0.1", 0))
        first = taken.getsockname()[1]
        monkeypatch.setenv(metrics.PROMETHEUS_ENV, f"127.0.0.1:{first}")
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
        monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
        with caplog.at_level(logging.INFO, logger="jetrl.metrics"):
            assert metrics.setup("jetrl-test", "host:1:test") is not None
        logged = re.search(r"Prometheus metrics on (\S+)", caplog.text)
        assert logged, caplog.text
        url = logged[1]
        assert int(url.split(":")[2].split("/")[0]) > first
        assert (
            metrics.setup("jetrl-test") is otel_metrics.get_meter_provider()
        )  # a second call: the same

        metrics.count_samples("reward", "scored", 3)
        metrics.count_samples("buffer", "dropped")
        metrics.REWARD.record(0.75)
        metrics.GENERATE_SECONDS.record(0.2, {"engine": "hf"})
        metrics.set_queue_depth("rollout", pending=5, in_flight=2)
        page = urllib.request.urlopen(url, timeout=10).read().decode()

    def value(name: str, **labels: str) -> float:
        """The sample of series `name` whose labels include `labels`
        (the exporter adds otel_scope_*)."""
        for line in page.splitlines():
            match = re.fullmatch(r"(\w+)\{(.*)\} (\S+)", line)
            if (
                match
                and match[1] == name
                and labels.items() <= dict(re.findall(r'(\w+)="([^"]*)"', match[2])).items()
            ):
                return float(match[3])
        raise AssertionError(f"{name} {labels} not in\n{page}")

    assert value("jetrl_samples_total", stage="reward", outcome="scored") == 3
    assert value("jetrl_samples_total", stage="buffer", outcome="dropped") == 1
    assert (
        value("jetrl_reward_bucket", le="0.8") == 1 and value("jetrl_reward_bucket", le="0.7") == 0
    )
    assert value("jetrl_generate_duration_seconds_count", engine="hf") == 1
    assert value("jetrl_queue_depth", queue="rollout", state="pending") == 5
    assert value("jetrl_queue_depth", queue="rollout", state="in_flight") == 2
    assert value("target_info", service_instance_id="host:1:test", service_name="jetrl-test") == 1
