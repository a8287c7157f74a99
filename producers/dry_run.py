"""`python -m producers.prompts --dry-run`: the run config as resolved (file, overrides,
`--steps`, `--run`) and what the run's streams would be made with, printed as two YAML
documents; nothing is started, nothing connects.

    config -> YAML (as the producer stores it in KV, `bus.runtime.publish_config`)
    config -> Topology.for_config (limits from `schemas.streams_config.stream_needs`)
        -> per stream: subjects, max_bytes, retention, discard, age limit, replicas, and the
           need's derivation; per work queue: its durable consumer's ack_wait, max_ack_pending,
           max_waiting

The limits are the ones `attach_bootstrap` declares the run with (`bus.topology.Topology.apply`),
read from the same objects, so what is printed is what the server would be asked for.
"""

from __future__ import annotations

from typing import Any

import yaml

from bus.topology import Topology
from schemas.config import RunConfig
from schemas.streams_config import stream_needs


def limits(cfg: RunConfig, replicas: int = 1) -> dict[str, Any]:
    """Every stream's settings and every work queue's consumer settings, as the run derives them."""
    topology = Topology.for_config(cfg, replicas)
    needs = stream_needs(cfg)
    streams: dict[str, Any] = {}
    consumers: dict[str, Any] = {}
    for channel in topology.channels:
        stream = topology.stream_config(channel)
        need = needs[channel.name]
        streams[str(stream.name)] = {
            "subjects": stream.subjects,
            "max_bytes": stream.max_bytes,
            "need_bytes": need.need,
            "retention": _name(stream.retention),
            "discard": _name(stream.discard),
            "max_age_s": stream.max_age,
            "replicas": stream.num_replicas,
            "derivation": need.how,
        }
    for channel in topology.work_queues:  # as `Topology.apply` makes them
        consumer = topology.consumer_config(channel)
        consumers[str(consumer.durable_name)] = {
            "stream": topology.stream(channel),
            "filter_subject": consumer.filter_subject,
            "ack_wait_s": consumer.ack_wait,
            "max_ack_pending": consumer.max_ack_pending,
            "max_waiting": consumer.max_waiting,
        }
    return {"streams": streams, "work_queues": consumers}


def _name(policy: object) -> str:
    return str(getattr(policy, "value", policy))


def render(cfg: RunConfig, replicas: int = 1) -> str:
    """The dry run's output: the config, then the derived limits, each a YAML document."""
    config = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    derived = yaml.safe_dump(limits(cfg, replicas), sort_keys=False, width=100)
    return (
        f"# the resolved run config (docs/config.md)\n{config}---\n"
        f"# what it derives: stream limits (schemas.streams_config) and work queues\n{derived}"
    )
