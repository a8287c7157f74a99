"""What every worker process does first: telemetry, connect, declare the run, read its config, join.

Workers are started with `--run R --nats URL` only; the run's config comes from the KV
bucket, where the producer put it (key `config`, the YAML of `RunConfig`). Once attached, a
worker heartbeats its membership entry (`bus.membership`) until it closes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import nats.errors
import yaml
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from bus import metrics, tracing
from bus.connection import DEFAULT_URL, ConnectRefused, JetStream, connect, worker_id
from bus.election import ride_out
from bus.identity import IDENTITY_ENV
from bus.membership import Membership
from bus.publisher import Publisher
from bus.topology import CONFIG_KEY, Topology, run_id_arg
from schemas.config import RunConfig, parse_config


class CannotAttach(Exception):
    """What a person must fix before this worker can join its run: said in one line."""


@dataclass
class Runtime:
    """A worker's connection to its run."""

    role: str
    nc: Client
    js: JetStream
    topology: Topology
    kv: KeyValue
    publisher: Publisher
    config: RunConfig
    member: Membership
    """This process's heartbeat entry; `member.report(...)` what it serves."""
    rank: int = 0
    """The data-parallel rank this worker serves (`--rank`; the trainer's)."""
    worker: str | None = None
    """This worker's id when a process runs several (`ops.bench.scale_workers`); None: the
    process's own, `bus.connection.worker_id(role)`."""

    @property
    def source(self) -> str:
        return self.worker or worker_id(self.role)

    async def close(self, timeout: float = 10.0) -> None:
        """Leave the members and drain; give up after `timeout` s (a server that is gone
        would otherwise keep a stopping worker alive forever)."""
        try:
            await asyncio.wait_for(self.member.leave(), timeout)
            await asyncio.wait_for(self.nc.drain(), timeout)
        except (TimeoutError, nats.errors.Error):
            await self.nc.close()


async def attach(
    role: str,
    run: str,
    url: str,
    replicas: int = 1,
    wait: float = 120.0,
    beat_in_background: bool = True,
    rank: int = 0,
    identity: str | Path | None = None,
) -> Runtime:
    """Connect, apply the run's topology, wait (up to `wait` s) for its config in KV,
    join the members.

    The membership heartbeat runs as a task of its own unless not `beat_in_background`: a
    stage (`bus.stage`) runs `rt.member.beat()` under its TaskGroup instead."""
    # Spans and metrics name the service (role) and the process (worker id) that made them.
    tracing.setup(f"jetrl-{role}", worker_id(role))
    metrics.setup(f"jetrl-{role}", worker_id(role))
    try:
        nc = await connect(url, worker_id(role), identity=identity)
    except ConnectRefused as exc:
        raise CannotAttach(str(exc)) from None
    js = nc.jetstream()
    topology = Topology(run=run, replicas=replicas)
    # A worker (or the producer) started while a node is down meets the election that follows.
    # Streams only once the config is read: their limits derive from it.
    await ride_out(lambda: topology.apply_buckets(js), f"declaring run {run}")
    kv = await ride_out(lambda: js.key_value(topology.kv_bucket), "opening the run's KV bucket")
    deadline = asyncio.get_running_loop().time() + wait
    while True:
        try:
            entry = await ride_out(lambda: kv.get(CONFIG_KEY), "reading the run config")
            break
        except KeyNotFoundError:
            if asyncio.get_running_loop().time() > deadline:
                raise CannotAttach(
                    f"run {run}: no config in KV after {wait:.0f}s; is the producer running?"
                ) from None
            await asyncio.sleep(0.5)
    config = parse_config(yaml.safe_load(entry.value or b""), f"run {run} config in KV")
    topology = Topology.for_config(config, replicas)
    await ride_out(lambda: topology.apply(js), f"declaring run {run}")
    member = await ride_out(
        lambda: Membership.join(js, topology, role, background=beat_in_background),
        "joining the run's members",
    )
    return Runtime(role, nc, js, topology, kv, Publisher(js, topology), config, member, rank)


async def publish_config(kv: KeyValue, config: RunConfig) -> None:
    await kv.put(
        CONFIG_KEY, yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False).encode()
    )


def worker_args(role: str, description: str, with_rank: bool = False) -> argparse.Namespace:
    """The command line every worker takes: --run R [--nats URL] [--replicas N] (+ --rank K)."""
    parser = argparse.ArgumentParser(prog=f"python -m consumers.{role}", description=description)
    parser.add_argument("--run", required=True, type=run_id_arg, help="run id")
    parser.add_argument(
        "--nats",
        default=os.environ.get("JETRL_NATS_URL", DEFAULT_URL),
        help="NATS URL(s), comma separated",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        choices=[1, 3, 5],
        default=1,
        help="stream replicas (3 on a cluster)",
    )
    parser.add_argument(
        "--identity",
        help=f"this role's nkey seed or creds file, mode 600 (default ${IDENTITY_ENV})",
    )
    if with_rank:
        parser.add_argument(
            "--rank", type=int, default=0, help="data-parallel rank this trainer trains"
        )
    args = parser.parse_args()
    if args.identity:  # a path, no secret: every connection of this process uses it
        os.environ[IDENTITY_ENV] = args.identity
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
    return args
