"""Storing a group's samples: as one event, or per sample where one event cannot hold them.

    group event -> fits the server's max payload? -> one publish (id <prompt id>/group)
                -> over it -> each sample's own event, one publish each (ids <prompt id>/<i>)

Readers take `each()` of whatever came (`schemas.group_events`), so a group stored either way
reads the same; only a sample too large alone is refused (EventTooLarge, to dead).
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from nats.js.api import PubAck

from bus.channels import Channel
from bus.publisher import EventTooLarge, Publisher
from bus.worker import Reject
from schemas import (
    RewardEvent,
    RewardGroupEvent,
    Rewards,
    Trajectories,
    TrajectoryEvent,
    TrajectoryGroupEvent,
)

G = TypeVar("G", Trajectories, Rewards)


async def send_group(
    publisher: Publisher, channel: Channel[G], group: G
) -> list[asyncio.Future[PubAck]]:
    """Start publishing `group` on `channel` (its samples one by one if it is too large as one);
    returns once each is in flight: await them for the stream's acks."""
    try:
        return [await publisher.send(channel, group)]
    except EventTooLarge:
        if isinstance(group, (TrajectoryEvent, RewardEvent)):
            raise  # a sample's own event: nothing smaller to send
    return [await publisher.send(channel, one) for one in group.each()]


async def publish_group(publisher: Publisher, channel: Channel[G], group: G) -> None:
    """`send_group` and wait until the stream has stored all of it."""
    await asyncio.gather(*await send_group(publisher, channel, group))


async def store_rewards(
    publisher: Publisher,
    channel: Channel[Rewards],
    scored: Trajectories | Rewards,
    rewards: list[RewardEvent],
    source: str,
) -> None:
    """Store the `rewards` of the samples `scored` carried (in its order) on `channel`: one
    group event for a group's event, else the sample's own. Reject (to dead, with the reason)
    for a sample too large to store: retrying cannot shrink it."""
    event: Rewards = (
        RewardGroupEvent(
            id=scored.id, run=scored.run, source=source, prompt_id=scored.prompt_id,
            rewards=tuple(rewards),
        )
        if isinstance(scored, (RewardGroupEvent, TrajectoryGroupEvent))
        else rewards[0]
    )  # fmt: skip
    try:
        await publish_group(publisher, channel, event)
    except EventTooLarge as exc:
        raise Reject(str(exc)) from None
