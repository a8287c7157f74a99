"""The loss guard: work a stream deleted before its work queue acked it.

A work queue's durable consumer has an ack floor: every message up to that stream sequence is
acked. The stream's first sequence is its oldest message still stored. When the first sequence
passes floor + 1, the messages in between were deleted (by a limit: bytes, age) while the
consumer had not acked them: work lost. Streams are made so that this cannot happen (discard
new, no age limit by default: `bus.topology`); the guard is what tells when it did anyway.

What the guard sees is work deleted before any worker fetched it. A message deleted while a
worker holds it moves the floor past it at once (the server drops it from the pending set; the
worker still has its data, finishes and publishes its result, but a crash would now lose it).
The floor also jumps past deleted messages once the consumer fetches again, so the gap shows only
until then: the workers check often (`watch`) and record what they saw in the run's KV
(`loss.<channel>`), where `ops.status` and `ops.audit` read it besides their own check.
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from bus.topology import Channel, Topology, loss_key
from schemas.kv_records import LossRecord

log = logging.getLogger("jetrl.loss")


async def lost(js: JetStreamContext, topology: Topology, channel: Channel) -> int | None:
    """Messages of `channel` deleted before its work queue acked them, as the server shows now;
    None when it cannot say (an election, the consumer missing)."""
    try:
        stream = await js.stream_info(topology.stream(channel))
        consumer = await js.consumer_info(topology.stream(channel), channel.work_queue.durable)
    except (nats.errors.Error, TimeoutError) as exc:
        log.info("loss guard on %s: no answer now: %s", channel.name, exc)
        return None
    floor = (
        consumer.ack_floor.stream_seq if consumer.ack_floor and consumer.ack_floor.stream_seq else 0
    )
    first = stream.state.first_seq
    if stream.state.messages == 0:
        # An empty stream's first sequence is one past its last: deleted up to last_seq.
        first = stream.state.last_seq + 1
    return max(0, first - 1 - floor)


async def recorded(kv: KeyValue, channel: Channel) -> int:
    """The most messages of `channel` a worker has seen lost (0 when none was)."""
    try:
        entry = await kv.get(loss_key(channel.name))
    except KeyNotFoundError:
        return 0
    return LossRecord.decode(entry.value).count


async def record(kv: KeyValue, channel: Channel, count: int) -> None:
    """Keep the largest count seen: a gap, once seen, stays counted after the floor moves on."""
    if count > await recorded(kv, channel):
        await kv.put(loss_key(channel.name), LossRecord(count=count).encode())


async def check(
    js: JetStreamContext, kv: KeyValue, topology: Topology, channel: Channel
) -> int | None:
    """One check: the gap now, recorded and reported loudly (ERROR) when there is one."""
    count = await lost(js, topology, channel)
    if count:
        log.error(
            "WORK LOST: stream %s deleted %d message(s) its work queue %s never acked (first "
            "sequence past the ack floor): a stream limit is too low (streams.max_bytes / "
            "streams.max_age_s)",
            topology.stream(channel),
            count,
            channel.work_queue.durable,
        )
        try:
            await record(kv, channel, count)
        except (nats.errors.Error, TimeoutError) as exc:  # an election: the next check records it
            log.info("loss guard on %s: cannot record now: %s", channel.name, exc)
    return count


async def watch(
    js: JetStreamContext, kv: KeyValue, topology: Topology, channel: Channel, every: float
) -> None:
    """Check `channel` every `every` seconds, for as long as the worker serves it
    (a stage helper)."""
    while True:
        await check(js, kv, topology, channel)
        await asyncio.sleep(every)


async def all_lost(js: JetStreamContext, kv: KeyValue, topology: Topology) -> dict[str, int | None]:
    """Every work queue's loss: the larger of the gap now and what workers recorded."""
    found: dict[str, int | None] = {}
    for channel in topology.work_queues:
        now = await lost(js, topology, channel)
        seen = await recorded(kv, channel)
        found[channel.name] = None if now is None and not seen else max(now or 0, seen)
    return found
