"""How far behind each work queue of a run is, read one way by everything that shows it.

The producer's progress line (and the queue-depth gauge), `ops.status`, `ops.streams` and
`ops.chaos` all read the durables of the run's work queues (`Topology.work_queues`) through
`queue_lag`; `queue_info` is one durable's whole description (its ack_wait, when it was
created).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo

from bus.topology import Channel, Topology

log = logging.getLogger("jetrl.lag")


@dataclass(frozen=True)
class QueueLag:
    """One work queue (durable consumer) as the server describes it now."""

    channel: Channel
    pending: int
    """Not yet delivered to any worker."""
    in_flight: int
    """Delivered, neither acked nor terminated."""
    redelivered: int
    """In flight and delivered more than once."""
    delivered: int
    """Stream sequence of the last message delivered."""

    @property
    def done(self) -> int:
        """Taken and settled so far: its difference between two readings is the work rate."""
        return self.delivered - self.in_flight


async def queue_info(js: JetStreamContext, topology: Topology, channel: Channel) -> ConsumerInfo:
    """The durable consumer of `channel`'s work queue as the server describes it now (raises
    what the bus raises when it cannot say)."""
    return await js.consumer_info(topology.stream(channel), channel.work_queue.durable)


async def queue_lag(js: JetStreamContext, topology: Topology) -> dict[str, QueueLag | None]:
    """Every work queue by its durable (the role of its workers), None for one the server
    cannot describe now (its stream electing a leader, the consumer deleted): a display shows
    that one as unknown and goes on."""
    found: dict[str, QueueLag | None] = {}
    for channel in topology.work_queues:
        durable = channel.work_queue.durable
        try:
            info = await queue_info(js, topology, channel)
        except (nats.errors.Error, TimeoutError) as exc:
            log.info("queue %s: no consumer info now: %s", durable, exc)
            found[durable] = None
            continue
        delivered = info.delivered.stream_seq if info.delivered and info.delivered.stream_seq else 0
        found[durable] = QueueLag(
            channel,
            info.num_pending or 0,
            info.num_ack_pending or 0,
            info.num_redelivered or 0,
            delivered,
        )
    return found
