"""The trainer's side of weight versions: `WeightsSender` stores each version and announces it.

    trainer  send(version, tensors): this rank's tensors of the version (every tensor with one
             publishing rank; its own shard when each rank publishes one)
    sender   `next_publication`: full (a chain start, or deltas off) or a delta on the version
             sent before -> full: a safetensors file of the tensors (`transport.publish`,
             hashed meanwhile); delta: the tensors encoded against the rank's copy of the base
             (`encode_shard`, in a thread) -> `publish_bytes` (the chain's versions are pinned:
             never pruned while the chain goes on; the transport prunes the rest, `keep`)
             -> the ranks exchange (location, size, names, manifest entries) of their shards
             (`Exchange`: an all-gather over the trainer's process group), so every rank
             builds the same event and pins every rank's payloads -> rank 0 announces the
             `WeightVersionEvent` on `weights` -> collective: every rank broadcasts its own
             tensors (the stored copy is the fallback) -> the tensors become the next base
             -> rank 0, once the event is out: the versions no worker needs any more are
             deleted from the store, behind the next step (`engines.weight_retention.needed`:
             the new version's chain, and the next version of each live rollout worker that
             lags within the staleness bound, by the versions their membership heartbeats
             report)

The published dtype is the rollout's, `model.dtype`: the trainer hands over its float32
masters and the sender casts their floating tensors (`engines.weights.in_dtype`), so a bf16 run
stores and moves half the bytes (measured: docs/weights.md). The base holds the tensors in the
published dtype, so that deltas apply bit for bit on the workers
(`consumers.weights.receiver`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import nats.errors
import torch

from bus import tracing
from bus.election import ride_out
from bus.membership import live_members, member_ids
from bus.publisher import Publisher
from bus.runtime import Runtime
from bus.topology import WEIGHTS
from consumers.weights.collective import CollectiveTransport
from consumers.weights.factory import transport_for
from consumers.weights.transport import Stored, WeightTransport
from engines.collective_plan import Spec
from engines.delta_plan import Chain, next_publication
from engines.device import torch_dtype
from engines.weight_delta import encode_shard
from engines.weight_retention import Published, needed
from engines.weights import in_dtype, manifest_of
from schemas.config import WeightsConfig
from schemas.weight_event import TensorSpec, TransportName, WeightShard, WeightVersionEvent

log = logging.getLogger("jetrl.weights.sender")

Served = Callable[[], Awaitable[list[int | None]]]
"""The version each live rollout worker serves (None: not reported yet)."""


class ShardNote(NamedTuple):
    """What one rank stored of a version: its shard and the manifest entries of its tensors."""

    shard: WeightShard
    manifest: tuple[TensorSpec, ...]
    address: str = ""
    """collective, rank 0: its broadcast's `host:port` (the other ranks join it there)."""


Exchange = Callable[[ShardNote], Awaitable[list[ShardNote]]]
"""This rank's note -> every rank's, in rank order (the same list on every rank). Every rank
calls it once per version it publishes."""


async def alone(note: ShardNote) -> list[ShardNote]:
    """The exchange of a single trainer rank."""
    return [note]


async def publish_version(
    transport: WeightTransport,
    run: str,
    source: str,
    version: int,
    tensors: dict[str, torch.Tensor],
    *,
    full_version: int | None = None,
) -> WeightVersionEvent:
    """Store `tensors` as `version` with `transport`; the event that announces them
    (`full_version`: `version`, when it starts a delta chain).

    Hashing (the manifest, in a thread) and storing run at the same time: storing waits on
    the server much of the time. A store refused during a leader election is retried: every
    try writes under a new name, so a repeat never changes bytes an event already points to."""
    manifest, stored = await asyncio.gather(
        asyncio.to_thread(manifest_of, tensors),
        ride_out(lambda: transport.publish(version, tensors), f"storing weights v{version}"),
    )
    return WeightVersionEvent.announce(
        run=run,
        source=source,
        version=version,
        step=version,
        transport=transport.name,
        location=stored.location,
        manifest=manifest,
        total_bytes=stored.total_bytes,
        full_version=full_version,
    )


class WeightsSender:
    """Sends the trainer's versions, full or delta as `weights.delta` and `full_every` say
    (collective: a full version stored through `weights.fallback`, then broadcast).

    `rank` of `world` publishing ranks stores its own shard of each version (the tensors it is
    given) and learns the other ranks' through `exchange`; every rank gets the same event, and
    rank 0 announces it on `publisher` (None: the caller announces what `store` returns).
    With `world` 1 the ranks other than 0 publish nothing (rank 0 gathered their tensors).
    `served` (rank 0): what the live rollout workers serve, read after each announcement to
    delete the versions none of them needs (`retire`; None: only the transport's `keep`
    bounds the store); `max_staleness`: the run's staleness bound."""

    def __init__(
        self,
        transport: WeightTransport,
        config: WeightsConfig,
        run: str,
        source: str,
        rank: int = 0,
        world: int = 1,
        exchange: Exchange = alone,
        publisher: Publisher | None = None,
        served: Served | None = None,
        max_staleness: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if isinstance(transport, CollectiveTransport):
            transport.senders = world
        self.transport, self.config, self.run, self.source = transport, config, run, source
        self.rank, self.world, self.exchange, self.publisher = rank, world, exchange, publisher
        self.chain: Chain | None = None
        """None until a version is stored: a trainer that starts or resumes sends a full one."""
        self.base: dict[str, torch.Tensor] = {}
        """This rank's tensors of the version stored last (the next delta's base)."""
        self.pinned: list[str] = []
        """Locations of the chain's versions so far, every rank's: pruning spares them for
        workers catching up."""
        self.owned: list[list[Spec]] | None = None
        """collective, several ranks: the specs of each rank's tensors of the last version."""
        self.source_address = ""
        """collective, several ranks: rank 0's broadcast address, from the exchange."""
        self.served, self.max_staleness = served, max_staleness
        self.published: list[Published] = []
        """rank 0 with `served`: the versions announced and still stored, in order."""
        self.retiring: asyncio.Task[None] | None = None
        """The last version's `retire`, running behind the trainer's next step."""
        self.dtype = dtype
        """The published dtype of floating tensors (the rollout's `model.dtype`)."""

    @classmethod
    def of(cls, rt: Runtime, rank: int, world: int, exchange: Exchange) -> WeightsSender:
        """The run's sender for trainer rank `rank` of `world` publishing ranks, through the
        configured transport (collective: to the live rollout workers)."""
        topology = rt.topology

        async def served() -> list[int | None]:
            members = await live_members(rt.js, topology)
            return [m.weight_version for m in members if m.role == "rollout"]

        transport = transport_for(
            rt.config.weights,
            rt.js,
            topology.object_bucket,
            topology.run,
            members=lambda: member_ids(rt.js, topology, "rollout"),
            writer=rank,
        )
        return cls(
            transport,
            rt.config.weights,
            topology.run,
            rt.source,
            rank,
            world,
            exchange,
            rt.publisher,
            served,
            rt.config.staleness.bound,
            torch_dtype(rt.config.model.dtype),
        )

    async def send(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Store `version` (`tensors`: this rank's, CPU copies in the published dtype, not
        changed after), announce it (rank 0), and start its broadcast (collective)."""
        if self.world == 1 and self.rank != 0:
            return  # rank 0 gathered this rank's tensors and sends the version
        await self.retired()  # the version before's, first
        # A copy of GBs: in a thread, so the event loop keeps serving the bus meanwhile.
        tensors = await asyncio.to_thread(in_dtype, tensors, self.dtype)
        with tracing.tracer.start_as_current_span(
            "publish weights", attributes={"jetrl.weight_version": version, "jetrl.run": self.run}
        ):
            # An election while storing is ridden out in there rather than restarting the trainer.
            event = await self.store(version, tensors)
            if self.rank == 0:
                assert self.publisher is not None, (
                    "rank 0's sender announces: give it the publisher"
                )
                await self.publisher.publish(WEIGHTS, event)
                # Behind the next step, not before it: reading every member and deleting took
                # 24 ms of the trainer's 155 ms step (ops.bench.learn). Awaited by the next send.
                self.retiring = asyncio.create_task(self.retire(event))
            await self.announced(
                version, tensors
            )  # collective: every rank's broadcast, in a thread

    async def store(self, version: int, tensors: dict[str, torch.Tensor]) -> WeightVersionEvent:
        """Store `version` (`tensors`: this rank's tensors of it, all of them with world 1, cast
        to the published dtype here if `send` has not); the event that announces it."""
        tensors = in_dtype(tensors, self.dtype)  # no copy when `send` cast them
        if isinstance(
            self.transport, CollectiveTransport
        ):  # the copy stored first, announced with the address
            store = self.transport.fallback(self.config.fallback)
            if self.world == 1:
                return self.transport.event(
                    await publish_version(store, self.run, self.source, version, tensors)
                )
            return self.transport.event(
                await self._full(version, None, tensors, store), self.source_address
            )
        if not self.config.delta:
            if self.world == 1:
                return await publish_version(
                    self.transport, self.run, self.source, version, tensors
                )
            return await self._full(version, None, tensors)
        base_version, chain = next_publication(version, self.chain, self.config.full_every)
        if base_version is None:
            if self.world == 1:
                event = await publish_version(
                    self.transport, self.run, self.source, version, tensors, full_version=version
                )
            else:
                event = await self._full(version, version, tensors)
            self.pinned = [shard.location for shard in event.shards] or [event.location]
        else:
            event = await self._delta(version, base_version, chain.full, tensors)
            self.pinned.extend(shard.location for shard in event.shards)
        self.chain = chain
        self.base = tensors
        return event

    async def retire(self, event: WeightVersionEvent) -> None:
        """After announcing `event`: delete every stored version no live rollout worker needs
        (`engines.weight_retention`). A failure to read the members or to delete is logged and
        left for the next version (nothing is deleted without knowing who needs what)."""
        if self.served is None:
            return
        if self.published and self.published[-1].version >= event.version:
            self.published = []  # not after the last: a new record (older payloads go as stale)
        collective = isinstance(self.transport, CollectiveTransport)
        locations = tuple(s.location for s in event.shards) or (
            (event.fallback_location or event.location) if collective else event.location,
        )
        self.published.append(Published(event.version, event.full_version, locations))
        try:
            keep = needed(self.published, await self.served(), self.max_staleness)
            kept = {where for p in keep for where in p.locations}
            deleted = await self.transport.retain(kept, event.version)
        except (nats.errors.Error, OSError) as exc:
            log.warning("old weight versions not deleted after v%d: %s", event.version, exc)
            return
        self.published = keep
        if deleted:
            log.info(
                "after v%d: %d stored payloads deleted, versions %s kept",
                event.version,
                len(deleted),
                [p.version for p in keep],
            )

    async def announced(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """After `version`'s event is out: collective starts its broadcast (workers wait for it)
        of the tensors in the published dtype, as `store` hashed them (no copy after `send`)."""
        if isinstance(self.transport, CollectiveTransport):
            tensors = in_dtype(tensors, self.dtype)
            await self.transport.broadcast(version, tensors, self.owned, self.source_address)

    async def retired(self) -> None:
        """Once the last version's `retire`, which `send` starts and does not wait for, is done
        (its error, if any, raised here: the trainer's next send or its close)."""
        if self.retiring is not None:
            task, self.retiring = self.retiring, None
            await task

    async def close(self) -> None:
        await self.retired()
        if isinstance(self.transport, CollectiveTransport):
            await self.transport.close()

    async def _full(
        self, version: int, full_version: int | None, tensors: dict[str, torch.Tensor],
        store: WeightTransport | None = None,
    ) -> WeightVersionEvent:  # fmt: skip
        """This rank's shard of a full version: a safetensors file of its tensors (the old
        chain's versions are no longer pinned), hashed while it is stored (`store`:
        collective's fallback)."""
        store = store or self.transport
        manifest, stored = await asyncio.gather(
            asyncio.to_thread(manifest_of, tensors),
            ride_out(lambda: store.publish(version, tensors), f"storing weights v{version}"),
        )
        return await self._announce(
            version, None, full_version, stored, tuple(tensors), manifest, store.name
        )

    async def _delta(
        self, version: int, base_version: int, full_version: int, tensors: dict[str, torch.Tensor]
    ) -> WeightVersionEvent:
        payload, manifest = await asyncio.to_thread(
            encode_shard,
            self.base,
            tensors,
            list(tensors),
            version=version,
            base_version=base_version,
            rank=self.rank,
            world=self.world,
        )
        pinned = tuple(self.pinned)
        stored = await ride_out(
            lambda: self.transport.publish_bytes(version, payload, pinned),
            f"storing weights delta v{version}",
        )
        return await self._announce(
            version, base_version, full_version, stored, tuple(tensors), manifest
        )

    async def _announce(
        self,
        version: int,
        base_version: int | None,
        full_version: int | None,
        stored: Stored,
        names: tuple[str, ...],
        manifest: tuple[TensorSpec, ...],
        transport: TransportName | None = None,
    ) -> WeightVersionEvent:
        """The event of `version` from every rank's stored shard (this rank's: `stored`)."""
        shard = WeightShard(location=stored.location, total_bytes=stored.total_bytes, tensors=names)
        collective = isinstance(self.transport, CollectiveTransport)
        address = self.transport.address if collective and self.rank == 0 else ""  # type: ignore[attr-defined]
        notes = await self.exchange(ShardNote(shard, manifest, address))
        if len(notes) != self.world or notes[self.rank].shard != shard:
            raise RuntimeError(
                f"v{version}: the shard exchange gave {len(notes)} notes for {self.world} ranks"
            )
        if collective:
            self.source_address = notes[0].address
            self.owned = [
                [(spec.name, spec.dtype, list(spec.shape)) for spec in note.manifest]
                for note in notes
            ]
        shards = tuple(note.shard for note in notes)
        return WeightVersionEvent.announce(
            run=self.run,
            source=self.source,
            version=version,
            step=version,
            base_version=base_version,
            full_version=full_version,
            transport=transport or self.transport.name,
            location=shards[0].location,
            manifest=tuple(spec for note in notes for spec in note.manifest),
            total_bytes=sum(s.total_bytes for s in shards),
            shards=shards,
        )
