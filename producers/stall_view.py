"""What the bus shows of a run at one moment, read once for the stall diagnosis
(`producers.stall`, which judges it, pure): who is live, each work queue's consumer, the trainer's
next step's stored micro-batches, prompts issued, the latest version, drop records and device
leases.

    read_view(js, topology, cfg) -> RunView
        members KV (live roles) . each work queue's consumer info . batches.<rank> read back
        from the end . the prompt stream's count . the last weight event . drops/leases KV

Every read is guarded (`_read`): a figure the bus cannot give now (a stream electing a leader)
is None, and the diagnosis leaves out the lines that need it. Kept apart from the judgement so
that `diagnose` is tested on views built by hand, and this module on a real server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError

from bus.lag import queue_info
from bus.membership import live_members, stored_keys
from bus.readers import LastStored, Poison
from bus.topology import (
    BATCHES,
    DROPS,
    LEASES,
    PROMPTS,
    WEIGHTS,
    Topology,
    metrics_key,
    metrics_of,
    metrics_prefix,
)
from producers.drops import DropTally
from schemas import BatchEvent
from schemas.config import RunConfig
from schemas.kv_records import DeviceLease, DropRecord, StepMetrics

log = logging.getLogger("jetrl.stall")
T = TypeVar("T")

SCAN_BATCHES = 256
"""Most batch-stream messages read back to find the micro-batches of the trainer's next step."""
UNREADABLE = (nats.errors.Error, asyncio.TimeoutError)


@dataclass(frozen=True)
class QueueView:
    """One work queue as its durable consumer says."""

    stage: str
    """The stream it reads."""
    pending: int
    """Not yet delivered."""
    in_flight: int
    """Delivered, neither acked nor terminated."""
    redelivered: int
    """In flight and delivered more than once (a holder went past ack_wait)."""
    ack_wait: float
    """Seconds after a holder's last heartbeat before its messages go back to the queue."""
    idle: float
    """Seconds since the queue last saw an ack (since it was created, if never)."""


@dataclass(frozen=True)
class StoredStep:
    """The micro-batches of one step stored for one trainer rank."""

    indices: frozenset[int]
    count: int
    """Micro-batches the step has for this rank."""


@dataclass(frozen=True)
class RunView:
    """What the bus shows of a run at one moment; None where it could not be read."""

    cfg: RunConfig
    live: Counter[str] | None
    """Live workers by role."""
    queues: dict[str, QueueView | None]
    next_step: int | None
    """The step the trainer trains next (steps recorded so far)."""
    stored: dict[int, StoredStep | None]
    """Rank -> what of `next_step` is stored for it (None: nothing)."""
    issued: int | None
    version: int | None
    """The latest weight version, as the gate counts it."""
    dropped: int | None
    drops: DropTally | None = None
    """The drops recorded since the last step (`since_step`, `recent_failures`); None: unknown."""
    leases: dict[str, DeviceLease] | None = None
    """`placement: colocated`: each device's lease by its KV key (`bus.lease`); None: unknown
    or separated."""


async def read_view(
    js: JetStreamContext,
    topology: Topology,
    cfg: RunConfig,
    *,
    next_step: int | None = None,
    issued: int | None = None,
    version: int | None = None,
    dropped: int | None = None,
    drops: DropTally | None = None,
    since: float | None = None,
) -> RunView:
    """The run as the bus shows it now. Figures the caller knows better (the producer knows its
    own issued count, version and drops) are taken as given; the others are read (the drops
    since the last step: those recorded after `since`, its unix time)."""
    if next_step is None:
        last = await guarded(last_step(js, topology))
        next_step = None if last is None else last[0] + 1
    live = await guarded(_live_roles(js, topology))
    queues = {
        c.work_queue.durable: await guarded(_queue(js, topology, c.work_queue.durable))
        for c in topology.work_queues
    }
    stored: dict[int, StoredStep | None] = {}
    if next_step is not None:
        for rank in range(cfg.trainer.dp_size):
            stored[rank] = await guarded(_stored(js, topology, rank, next_step))
    if issued is None:
        issued = await guarded(_stream_messages(js, topology))
    if version is None:
        version = await guarded(_latest_version(js, topology))
    if dropped is None:
        dropped = await guarded(_count_keys(js, topology, DROPS.filter))
    if drops is None and since is not None:
        drops = await guarded(read_drops(js, topology, since))
    leases = await guarded(_leases(js, topology)) if cfg.placement == "colocated" else None
    return RunView(cfg, live, queues, next_step, stored, issued, version, dropped, drops, leases)


async def guarded(reading: Awaitable[T]) -> T | None:
    """The figure, or None when the bus cannot say now."""
    try:
        return await reading
    except UNREADABLE as exc:
        log.info("stall diagnosis: a figure is unknown now: %r", exc)
        return None


async def _leases(js: JetStreamContext, topology: Topology) -> dict[str, DeviceLease]:
    kv = await js.key_value(topology.kv_bucket)
    leases = {}
    for key in await stored_keys(js, topology.kv_bucket, LEASES.filter):
        with contextlib.suppress(KeyNotFoundError, KeyDeletedError):
            leases[key] = DeviceLease.decode((await kv.get(key)).value)
    return leases


async def _live_roles(js: JetStreamContext, topology: Topology) -> Counter[str]:
    return Counter(m.role for m in await live_members(js, topology))


async def _queue(js: JetStreamContext, topology: Topology, role: str) -> QueueView:
    channel = topology.served_by(role)
    assert channel is not None, f"{role} serves no work queue"
    queue = channel.work_queue
    info = await queue_info(js, topology, channel)
    acked = (
        info.ack_floor.last_active
        if info.ack_floor and info.ack_floor.last_active
        else info.created
    )
    return QueueView(
        channel.name,
        info.num_pending or 0,
        info.num_ack_pending or 0,
        info.num_redelivered or 0,
        info.config.ack_wait or queue.ack_wait,
        max(0.0, time.time() - acked.timestamp()),
    )


async def _stored(
    js: JetStreamContext, topology: Topology, rank: int, step: int
) -> StoredStep | None:
    """The micro-batches of `step` on batches.<rank>, read back from the stream's end: the buffer
    stores a step's micro-batches together and the steps in order, so they are the last ones of
    that step before an earlier step (or a later one) begins."""
    # Garbage the trainer dead-letters is logged and stepped over, as deleted batches are.
    batches: LastStored[BatchEvent] = LastStored(js, topology, BATCHES, Poison("stall watch"))
    end = await batches.last_seq(rank)
    if not end:
        return None
    indices: set[int] = set()
    count = 0
    async for stored in batches.back(start=end, limit=SCAN_BATCHES):
        batch = stored.event
        if batch.dp_rank != rank or batch.step > step:
            continue
        if batch.step < step:
            break
        indices.add(batch.micro_index)
        count = batch.micro_count
    return StoredStep(frozenset(indices), count) if indices else None


async def _stream_messages(js: JetStreamContext, topology: Topology) -> int:
    """Prompts issued: the messages of the prompt stream."""
    return (await js.stream_info(topology.stream(PROMPTS))).state.messages


async def _latest_version(js: JetStreamContext, topology: Topology) -> int:
    """The latest weight version; 0 before the first, as the gate counts it."""
    last = await LastStored(js, topology, WEIGHTS, Poison("stall watch")).last()
    return 0 if last is None else last.event.version


async def _count_keys(js: JetStreamContext, topology: Topology, pattern: str) -> int:
    return len(await stored_keys(js, topology.kv_bucket, pattern))


async def read_drops(js: JetStreamContext, topology: Topology, since: float) -> DropTally:
    """Every drop record of the run, counted; those recorded after `since` (unix time) also as
    the drops since the last step. Read by one KV watch: its initial values end at a None."""
    kv = await js.key_value(topology.kv_bucket)
    watcher = await kv.watch(DROPS.filter)
    tally, recent = DropTally(), DropTally()
    try:
        while (entry := await watcher.updates(timeout=5.0)) is not None:
            if entry.value is None:
                continue
            record = DropRecord.decode(entry.value)
            tally.add(record)
            if record.time is not None and record.time >= since:
                recent.add(record)
    finally:
        await watcher.stop()
    tally.since_step, tally.recent_failures = recent.kinds, recent.failures
    return tally


async def last_step(js: JetStreamContext, topology: Topology) -> tuple[int, float]:
    """The last step rank 0 recorded and the time it recorded it; (-1, when the run's queues were
    declared) before any. Raises what the bus raises when it cannot say now."""
    keys = await stored_keys(js, topology.kv_bucket, metrics_prefix(0) + "*")
    steps = [rank_step[1] for key in keys if (rank_step := metrics_of(key)) is not None]
    if not steps:
        return -1, (await queue_info(js, topology, PROMPTS)).created.timestamp()
    entry = await (await js.key_value(topology.kv_bucket)).get(metrics_key(0, max(steps)))
    try:
        return max(steps), StepMetrics.decode(entry.value).time
    except ValueError:  # not the trainer's metrics: the step counts, its time not
        return max(steps), time.time()
