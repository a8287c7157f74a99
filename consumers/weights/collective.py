"""Weight versions broadcast from the trainer ranks over torch.distributed,
with a stored fallback copy.

    trainer  publish: the version stored through `weights.fallback` (object store or files, as
             without the broadcast) -> the event says `collective`, the rendezvous address
             (`host:port`) and where the copy is -> announced -> `broadcast`: the live rollout
             workers (membership) refreshed, `CollectiveSource.publish` in a thread (one
             broadcast at a time: the next version waits for the one before)
    ranks    with several (FSDP) trainer ranks each stores its own shard of the fallback copy
             (`WeightsSender`, as without the broadcast) and sends the buckets of its own
             tensors: rank 0's source coordinates (its address in the event; the other ranks
             learn it in the shard exchange), ranks 1.. join as `CollectivePeer`s
    worker   fetch: `CollectiveReceiver.receive(into=None)` in a thread (generation goes on; the
             tensors are views of a staging buffer of its own) -> checked against the manifest
             -> the engine loads them under the gate. `Missed` (joined late, dropped from the
             group, the trainer gave up, source gone) -> the fallback copy, fetched as any
             version of that transport
    engines  a worker whose engine copies take a broadcast themselves (`GroupWeights`; one
             sender): `into_engines` under the stage's gate, `EngineReceiver` joining them to
             the group and asking each to receive and read back (`engines.collective_engine`);
             `Missed` -> the fallback copy, loaded whole by the stage

`engines.collective` holds the protocol (check-in, group epochs, timeouts); docs/weights.md
("Collective transport") describes both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import ClassVar

import torch

from consumers.weights.transport import Stored, WeightsUnavailable, WeightTransport, fetch_full
from engines.collective import (
    CollectiveReceiver,
    CollectiveSettings,
    CollectiveSource,
    Missed,
    Published,
)
from engines.collective_engine import EngineReceiver
from engines.collective_peer import CollectivePeer
from engines.collective_plan import Spec
from engines.weights import verify
from engines.weights_group import GroupWeights
from schemas.config import MIB, WeightsConfig
from schemas.weight_event import TransportName, WeightShard, WeightVersionEvent

log = logging.getLogger("jetrl.weights.collective")


def settings_of(config: WeightsConfig) -> CollectiveSettings:
    c = config.collective
    return CollectiveSettings(
        backend=c.backend,
        device=c.device,
        bucket_bytes=c.bucket_mib * MIB,
        op_timeout_s=c.op_timeout_s,
        join_timeout_s=c.join_timeout_s,
        max_attempts=c.max_attempts,
    )


class CollectiveTransport:
    """The trainer's broadcast (`members`: the live rollout workers' ids; `rank`: this trainer
    rank) or a worker's receiver (`member_id`: its own id, as `members` names it); `fallback`
    builds the stored copy's transport."""

    name: ClassVar[TransportName] = "collective"

    def __init__(
        self,
        config: WeightsConfig,
        fallback: Callable[[TransportName], WeightTransport],
        members: Callable[[], Awaitable[list[str]]] | None = None,
        member_id: str = "",
        rank: int = 0,
    ) -> None:
        self.config, self.settings = config, settings_of(config)
        self.fallback = fallback
        self.members, self.member_id, self.rank = members, member_id, rank
        self.senders = 1
        """Trainer ranks that send (each its own tensors); set by the publisher before the first
        version."""
        self.peer: CollectivePeer | None = None
        self.alive: list[str] = []
        """The members the next broadcast goes to (refreshed before each;
        read by the source's thread)."""
        self.source: CollectiveSource | None = None
        self.receiver: CollectiveReceiver | None = None
        self.engine_receiver: EngineReceiver | None = None
        self.sending: asyncio.Task[Published] | None = None

    # --- trainer ---------------------------------------------------------------------------

    @property
    def address(self) -> str:
        if self.source is None:
            c = self.config.collective
            assert self.rank == 0, "trainer rank 0 hosts the broadcast; the other ranks join it"
            self.source = CollectiveSource(
                lambda: self.alive, self.settings, c.host, c.port, self.senders
            )
        host, port = self.source.address
        return f"{host}:{port}"

    async def publish(
        self, version: int, tensors: dict[str, torch.Tensor], pinned: Collection[str] = ()
    ) -> Stored:
        """Store the fallback copy; the broadcast itself starts once the event is out
        (`broadcast`)."""
        return await self.fallback(self.config.fallback).publish(version, tensors, pinned)

    async def publish_bytes(
        self, version: int, data: bytes, pinned: Collection[str] = ()
    ) -> Stored:
        raise WeightsUnavailable(
            "collective broadcasts full versions; delta payloads go through a store"
        )

    async def retain(self, kept: Collection[str], latest: int) -> list[str]:
        """The fallback copies: what the broadcast itself leaves behind is nothing."""
        return await self.fallback(self.config.fallback).retain(kept, latest)

    def event(self, stored: WeightVersionEvent, address: str = "") -> WeightVersionEvent:
        """`stored` (the event of the fallback copy, in shards with several ranks) as the
        collective version's event; `address`: rank 0's source (default: this rank's own)."""
        return WeightVersionEvent.announce(
            **{
                **stored.model_dump(exclude={"id"}),
                "transport": "collective",
                "location": address or self.address,
                "fallback_transport": stored.transport,
                "fallback_location": stored.location,
            }
        )

    async def broadcast(
        self,
        version: int,
        tensors: dict[str, torch.Tensor],
        owned: list[list[Spec]] | None = None,
        address: str = "",
    ) -> None:
        """Start broadcasting `version` (announced already: receivers wait for the plan) in a
        thread, after the broadcast before it ended. `tensors`: this rank's own; rank 0:
        `owned[r]`, the specs of rank r's tensors (default: `tensors` alone); ranks 1..: the
        `address` of rank 0's source."""
        await self.settle()
        if self.rank > 0:
            host, _, port = address.rpartition(":")
            self.peer = self.peer or CollectivePeer(self.rank, self.settings)
            self.sending = asyncio.create_task(
                asyncio.to_thread(self.peer.publish, (host, int(port)), version, tensors)
            )
            return
        assert self.members is not None, "the trainer's transport lists the members"
        self.alive = await self.members()
        self.address  # noqa: B018 - the source exists before its thread runs
        assert self.source is not None
        self.sending = asyncio.create_task(
            asyncio.to_thread(self.source.publish, version, tensors, owned)
        )

    async def settle(self) -> Published | None:
        """Wait for the broadcast in flight (bounded: every attempt has its timeouts)."""
        if self.sending is None:
            return None
        sending, self.sending = self.sending, None
        published = await sending
        if published.reason:
            log.warning(
                "weights v%d: broadcast to %s: %s",
                published.version,
                published.members,
                published.reason,
            )
        else:
            log.info(
                "weights v%d: sent %d bytes (this rank's tensors) of %d to %d workers in %.2fs",
                published.version,
                published.sent,
                published.nbytes,
                len(published.members),
                published.seconds,
            )
        return published

    async def close(self) -> None:
        await self.settle()
        if self.source is not None:
            self.source.close()
            self.source = None
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        if self.engine_receiver is not None:
            self.engine_receiver.close()
            self.engine_receiver = None

    # --- worker ----------------------------------------------------------------------------

    async def fetch(self, event: WeightVersionEvent) -> dict[str, torch.Tensor]:
        host, _, port = event.location.rpartition(":")
        if self.receiver is None:
            self.receiver = CollectiveReceiver(self.member_id, self.settings)
        got = await asyncio.to_thread(self.receiver.receive, (host, int(port)), event.version)
        if isinstance(got, Missed):
            return await self.catch_up(event, got.reason)
        await asyncio.to_thread(verify, got.tensors, event.manifest)
        return got.tensors

    async def into_engines(
        self, event: WeightVersionEvent, engines: Sequence[GroupWeights]
    ) -> dict[str, torch.Tensor] | None:
        """`event`'s version broadcast into the `engines` themselves (their own weight-update
        calls; only while the stage holds them quiet): None once every copy holds it, each load
        read back; else (`Missed`, for whatever reason) the fallback copy's tensors, verified,
        for the stage to load whole."""
        host, _, port = event.location.rpartition(":")
        if self.engine_receiver is None:
            self.engine_receiver = EngineReceiver(self.member_id, self.settings, engines)
        checksums = {spec.name: spec.sha256 for spec in event.manifest}
        got = await asyncio.to_thread(
            self.engine_receiver.receive, (host, int(port)), event.version, checksums
        )
        if isinstance(got, Missed):
            return await self.catch_up(event, got.reason)
        log.info(
            "weights v%d: %d bytes by broadcast into the engines in %.2fs (epoch %d)",
            got.version,
            got.nbytes,
            got.seconds,
            got.epoch,
        )
        return None

    async def catch_up(self, event: WeightVersionEvent, reason: str) -> dict[str, torch.Tensor]:
        if event.fallback_transport is None or event.fallback_location is None:
            raise WeightsUnavailable(f"v{event.version} missed ({reason}) and has no fallback copy")
        log.info(
            "weights v%d missed by broadcast (%s): from the %s copy",
            event.version,
            reason,
            event.fallback_transport,
        )
        stored = WeightVersionEvent.model_validate(
            {
                **event.model_dump(),
                "transport": event.fallback_transport,
                "location": event.fallback_location,
                "fallback_transport": None,
                "fallback_location": None,
            }
        )
        return await fetch_full(self.fallback(event.fallback_transport), stored)

    async def fetch_bytes(self, shard: WeightShard) -> bytes:
        raise WeightsUnavailable("collective versions have no delta shards")
