"""What `ops.bench.scale` reads from the cluster while a run goes on, once a second.

    every `every` s -> a Sample:
        per node: /varz in_msgs (clients and routes) from its monitoring port, and the
            nats-server process's CPU seconds (utime + stime, /proc/<pid>/stat)
        the fleet's processes' CPU seconds, by role (/proc)
        streams: trajectories' last sequence (samples generated, whatever the retention),
            the members bucket's and the run KV bucket's last sequences (KV writes)
        work queues: pending (not yet delivered), ack pending, waiting pull requests
    a watch of the members bucket + a subscription to the weights subject ->
        per version: when it was announced, when every live rollout member had loaded it

All of it is read from outside the run (HTTP, /proc, stream and consumer info, a KV watch):
nothing in the stages is instrumented for the benchmark.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from bus.embedded import LOOPBACK, EmbeddedCluster
from bus.lag import queue_info
from bus.topology import PROMPTS, REWARDS, TRAJECTORIES, WEIGHTS, Channel, Topology
from schemas import WeightVersionEvent, decode
from schemas.kv_records import Member

TICKS = os.sysconf("SC_CLK_TCK")
QUEUES: tuple[Channel, ...] = (PROMPTS, TRAJECTORIES, REWARDS)
"""The work queues watched: rollout (prompts), reward (trajectories), buffer (rewards)."""


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS  # fields 14 and 15 of proc(5)


@dataclass
class Queue:
    pending: int
    ack_pending: int
    waiting: int
    max_ack_pending: int


@dataclass
class Sample:
    time: float
    server_msgs: int
    """Messages the nodes received, all nodes together (client publishes, acks, requests and
    the routes' replication)."""
    server_cpu: float
    fleet_cpu: dict[str, float]
    trajectories: int
    member_writes: int
    kv_writes: int
    queues: dict[str, Queue]


@dataclass
class Reach:
    """Weight versions: announced at, and loaded by every live rollout member at."""

    announced: dict[int, float] = field(default_factory=dict)
    loaded: dict[str, int] = field(default_factory=dict)
    """Rollout member key -> the version its entry reports."""
    everywhere: dict[int, float] = field(default_factory=dict)

    def update(self, key: str, member: Member | None, now: float) -> None:
        if member is None:  # left or expired
            self.loaded.pop(key, None)
        elif member.role == "rollout" and member.weight_version is not None:
            self.loaded[key] = member.weight_version
        if not self.loaded:
            return
        oldest = min(self.loaded.values())
        for version in self.announced:
            if version <= oldest and version not in self.everywhere:
                self.everywhere[version] = now

    def seconds(self) -> dict[int, float]:
        """Announcement -> on every live rollout worker, per version seen both ways."""
        return {
            v: self.everywhere[v] - t for v, t in self.announced.items() if v in self.everywhere
        }


class Probe:
    def __init__(
        self,
        nc: Client,
        topology: Topology,
        cluster: EmbeddedCluster,
        fleet_pids: Callable[[], dict[str, list[int]]],
    ) -> None:
        self.nc, self.js, self.topology, self.cluster = nc, nc.jetstream(), topology, cluster
        self.fleet_pids = fleet_pids
        """Role -> its live processes' pids (asked each sample: the fleet may restart one)."""
        self.samples: list[Sample] = []
        self.reach = Reach()

    async def sample(self) -> Sample:
        msgs = sum(await asyncio.gather(*(asyncio.to_thread(self._in_msgs, i) for i in range(3))))
        queues = {}
        for channel in QUEUES:
            info = await queue_info(self.js, self.topology, channel)
            queues[channel.name] = Queue(
                info.num_pending or 0,
                info.num_ack_pending or 0,
                info.num_waiting or 0,
                info.config.max_ack_pending or 0,
            )
        return Sample(
            time=time.time(),
            server_msgs=msgs,
            server_cpu=sum(cpu_seconds(n.process.pid) for n in self.cluster.nodes if n.process),
            fleet_cpu={r: sum(map(cpu_seconds, pids)) for r, pids in self.fleet_pids().items()},
            trajectories=await self._last_seq(self.topology.stream(TRAJECTORIES)),
            member_writes=await self._last_seq(f"KV_{self.topology.members_bucket}"),
            kv_writes=await self._last_seq(f"KV_{self.topology.kv_bucket}"),
            queues=queues,
        )

    def _in_msgs(self, index: int) -> int:
        port = self.cluster.addresses[index].http_port
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/varz", timeout=5) as response:
            return int(json.load(response)["in_msgs"])

    async def _last_seq(self, stream: str) -> int:
        try:
            return (await self.js.stream_info(stream)).state.last_seq
        except NotFoundError:
            return 0

    async def declared(self, wait: float) -> KeyValue:
        """The members bucket, once the run's buckets and work queues exist."""
        deadline = time.monotonic() + wait
        while True:
            try:
                kv = await self.js.key_value(self.topology.members_bucket)
                await self.sample()  # every queue it reads is there
                return kv
            except (BucketNotFoundError, NotFoundError):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"run {self.topology.run} not declared after {wait} s"
                    ) from None
                await asyncio.sleep(0.5)

    async def run(self, every: float = 1.0, wait: float = 120.0) -> None:
        """Sample every `every` s and follow the weight versions, until cancelled; from when
        the producer has declared the run (at most `wait` s)."""
        kv = await self.declared(wait)
        watcher = await kv.watchall()

        async def on_weights(msg: Msg) -> None:
            event: object = decode(msg.data)
            if isinstance(event, WeightVersionEvent):
                self.reach.announced.setdefault(event.version, time.time())

        sub = await self.nc.subscribe(self.topology.subject(WEIGHTS), cb=on_weights)

        async def follow_members() -> None:
            async for entry in watcher:
                if entry is None:  # the end of the initial values
                    continue
                member = None if entry.operation or not entry.value else Member.decode(entry.value)
                self.reach.update(entry.key, member, time.time())

        async def sampling() -> None:
            while True:
                self.samples.append(await self.sample())
                await asyncio.sleep(every)

        try:
            async with asyncio.TaskGroup() as group:  # cancelled together, or failed together
                group.create_task(follow_members())
                group.create_task(sampling())
        finally:
            await sub.unsubscribe()
            await watcher.stop()
