"""`ops/compose.yaml` (no Docker here): it parses, and what it points at exists and agrees."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
OPS = ROOT / "ops"


def test_compose_runs_the_cluster_configs_jaeger_and_a_fleet() -> None:
    services = yaml.safe_load((OPS / "compose.yaml").read_text())["services"]
    assert set(services) == {"nats1", "nats2", "nats3", "jaeger", "fleet"}
    client_urls = []
    for i in (1, 2, 3):
        node = services[f"nats{i}"]
        source, target = node["volumes"][0].split(":")[:2]
        config = node["command"][-1]
        assert config.startswith(f"{target}/")
        conf = (
            OPS / source / config.removeprefix(f"{target}/")
        ).read_text()  # the node's file in ops/cluster
        assert f"server_name: n{i}" in conf
        listen = re.search(r"^listen: (\S+)", conf, re.M)
        assert listen, conf
        client_urls.append("nats://" + listen[1])
        assert node["network_mode"] == "host"  # the configs listen and route on loopback

    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one:")
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"

    fleet = services["fleet"]
    env = fleet["environment"]
    assert env["JETRL_NATS_URL"].split(",") == client_urls
    assert (
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://127.0.0.1:4318/v1/traces"
    )  # Jaeger's OTLP/HTTP port
    script = fleet["command"][-1]
    assert "pip install -q -e '.[prometheus]'" in script  # the workers serve JETRL_PROMETHEUS_PORT
    assert "python -m ops.streams apply --run demo --replicas 3" in script
    found = re.search(r"python -m consumers\.fleet --config (\S+)", script)
    assert found, script
    fleet_config = found[1]
    assert yaml.safe_load((ROOT / fleet_config).read_text())["run"] == "demo"
