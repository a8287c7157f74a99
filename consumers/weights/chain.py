"""Delta versions through a weight transport: the trainer's side (`VersionPublisher`) and a worker's (`Follower`).

    trainer  version v -> `next_publication`: full (chain start) or a delta on the version
             published before -> full: `publish_version` as without deltas; delta: the rank's
             tensors (`assign_shards`) encoded against its copy of the base
             (`encode_shard`, in a thread) -> `publish_bytes` (the chain's versions are
             pinned: never pruned while the chain goes on) -> the event (base, chain's full
             version, shards) -> the published tensors become the next base
    ranks    with several trainer ranks each rank publishes only its own tensors (its shard):
             a delta's `encode_shard` payload, or a full version's safetensors file of them;
             the ranks then exchange (location, size, names, manifest entries) of their
             shards (`Exchange`: an all-gather over the trainer's process group), so every
             rank builds the same event and pins every rank's payloads; rank 0 announces it
    worker   event v -> `plan_fetch` from the version of its CPU copy -> the chain's earlier
             events (from the `weights` stream, `Earlier`) -> full fetch (`fetch_full`: each
             shard, if any, fetched as a full version of its tensors, streamed and checked by
             the transport) and/or each delta's
             shards (`fetch_bytes`) applied onto the copy (`apply_delta`, in a thread: all or
             nothing, every result tensor checked against its manifest) -> the copy, for the
             engine to load under the gate

The copy and the base hold the tensors in the published dtype, so that deltas apply bit for
bit. A delta that fails to apply drops the worker's copy: its next version is pulled from the
chain's full version (a trainer resumed from a checkpoint may have published other bytes under
the versions the copy went through).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import torch

from bus.election import ride_out
from consumers.weights.collective import CollectiveTransport
from consumers.weights.transport import Stored, WeightsMissing, WeightTransport, fetch_full, publish_version
from engines.delta_plan import Chain, next_publication, plan_fetch
from engines.weight_delta import apply_delta, encode_shard
from engines.weights import WeightsRefused, manifest_of
from schemas.config import WeightsConfig
from schemas.weight_event import TensorSpec, TransportName, WeightShard, WeightVersionEvent

Earlier = Callable[[set[int], int], Awaitable[dict[int, WeightVersionEvent]]]
"""(versions, full version) -> the events of those versions on the chain starting at that
full version, published before the event being followed; WeightsMissing for any not found."""


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


class VersionPublisher:
    """Publishes the trainer's versions, full or delta as `weights.delta` and `full_every` say
    (collective: a full version stored through `weights.fallback`, then broadcast).

    `rank` of `world` stores its own shard of each version (the tensors it is given) and
    learns the other ranks' through `exchange`; every rank gets the same event, and one (rank
    0) announces it. Collective: the stored copy as above (its shards), then every rank
    broadcasts its own tensors (`announced`), rank 0 coordinating."""

    def __init__(self, transport: WeightTransport, config: WeightsConfig, run: str, source: str,
                 rank: int = 0, world: int = 1, exchange: Exchange = alone) -> None:
        if isinstance(transport, CollectiveTransport):
            transport.senders = world
        self.transport, self.config, self.run, self.source = transport, config, run, source
        self.rank, self.world, self.exchange = rank, world, exchange
        self.chain: Chain | None = None
        """None until a version is published: a trainer that starts or resumes publishes a full one."""
        self.base: dict[str, torch.Tensor] = {}
        """This rank's tensors of the version published last (the next delta's base)."""
        self.pinned: list[str] = []
        """Locations of the chain's versions so far, every rank's: pruning spares them for
        workers catching up."""
        self.owned: list[list[tuple[str, str, list[int]]]] | None = None
        """collective, several ranks: the specs of each rank's tensors of the version published last."""
        self.source_address = ""
        """collective, several ranks: rank 0's broadcast address, from the exchange."""

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> WeightVersionEvent:
        """Store `version` (`tensors`: this rank's tensors of it, all of them with world 1; CPU
        copies in the published dtype, not changed after); the event that announces it."""
        if isinstance(self.transport, CollectiveTransport):  # the copy stored first, announced with the address
            store = self.transport.fallback(self.config.fallback)
            if self.world == 1:
                return self.transport.event(await publish_version(store, self.run, self.source, version, tensors))
            return self.transport.event(await self._full(version, None, tensors, store), self.source_address)
        if not self.config.delta:
            if self.world == 1:
                return await publish_version(self.transport, self.run, self.source, version, tensors)
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

    async def announced(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """After `version`'s event is out: collective starts its broadcast (workers wait for it)."""
        if isinstance(self.transport, CollectiveTransport):
            await self.transport.broadcast(version, tensors, self.owned, self.source_address)

    async def close(self) -> None:
        if isinstance(self.transport, CollectiveTransport):
            await self.transport.close()

    async def _full(
        self, version: int, full_version: int | None, tensors: dict[str, torch.Tensor],
        store: WeightTransport | None = None,
    ) -> WeightVersionEvent:  # fmt: skip
        """This rank's shard of a full version: a safetensors file of its tensors (the old chain's
        versions are no longer pinned), hashed while it is stored (`store`: collective's fallback)."""
        store = store or self.transport
        manifest, stored = await asyncio.gather(
            asyncio.to_thread(manifest_of, tensors),
            ride_out(lambda: store.publish(version, tensors), f"storing weights v{version}"),
        )
        return await self._announce(version, None, full_version, stored, tuple(tensors), manifest, store.name)

    async def _delta(
        self, version: int, base_version: int, full_version: int, tensors: dict[str, torch.Tensor]
    ) -> WeightVersionEvent:
        payload, manifest = await asyncio.to_thread(
            encode_shard, self.base, tensors, list(tensors),
            version=version, base_version=base_version, rank=self.rank, world=self.world,
        )
        pinned = tuple(self.pinned)
        stored = await ride_out(
            lambda: self.transport.publish_bytes(version, payload, pinned), f"storing weights delta v{version}"
        )
        return await self._announce(version, base_version, full_version, stored, tuple(tensors), manifest)

    async def _announce(
        self, version: int, base_version: int | None, full_version: int | None, stored: Stored,
        names: tuple[str, ...], manifest: tuple[TensorSpec, ...], transport: TransportName | None = None,
    ) -> WeightVersionEvent:
        """The event of `version` from every rank's stored shard (this rank's: `stored`)."""
        shard = WeightShard(location=stored.location, total_bytes=stored.total_bytes, tensors=names)
        collective = isinstance(self.transport, CollectiveTransport)
        address = self.transport.address if collective and self.rank == 0 else ""  # type: ignore[attr-defined]
        notes = await self.exchange(ShardNote(shard, manifest, address))
        if len(notes) != self.world or notes[self.rank].shard != shard:
            raise RuntimeError(f"v{version}: the shard exchange gave {len(notes)} notes for {self.world} ranks")
        if collective:
            self.source_address = notes[0].address
            self.owned = [[(spec.name, spec.dtype, list(spec.shape)) for spec in note.manifest] for note in notes]
        shards = tuple(note.shard for note in notes)
        return WeightVersionEvent.announce(
            run=self.run, source=self.source, version=version, step=version,
            base_version=base_version, full_version=full_version, transport=transport or self.transport.name,
            location=shards[0].location, manifest=tuple(spec for note in notes for spec in note.manifest),
            total_bytes=sum(s.total_bytes for s in shards), shards=shards,
        )


class Follower:
    """A worker's CPU copy of the chain version it serves, brought to each new version."""

    def __init__(self) -> None:
        self.copy: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        """The version `copy` holds; None: no copy (none yet, or dropped after a failed delta)."""
        self.event_id: str | None = None
        """Id of the event of the version `copy` holds: a resumed trainer's event of that version
        (another id) announces other bytes."""

    async def fetch(
        self, event: WeightVersionEvent, transport_of: Callable[[WeightVersionEvent], WeightTransport], earlier: Earlier
    ) -> dict[str, torch.Tensor]:
        """`event`'s tensors. Outside a chain: fetched as a full version, no copy kept. On a
        chain: the copy, brought to `event.version` (full version and deltas as `plan_fetch`
        says); its tensors are the copy's, to be loaded before the next `fetch`."""
        if event.full_version is None:
            return await fetch_full(transport_of(event), event)
        if self.version == event.version and self.event_id != event.id:
            self.copy, self.version = {}, None  # the copy is another chain's version of that number
        if event.base_version is None:
            await self._full(event, transport_of(event))
            return self.copy
        plan = plan_fetch(event.version, event.full_version, self.version, event.version - event.base_version)
        needed = {step.version for step in plan} - {event.version}
        events = {event.version: event, **(await earlier(needed, event.full_version) if needed else {})}
        if set(events) < {step.version for step in plan}:
            raise WeightsMissing(f"v{event.version}: the events of its chain's versions {sorted(needed - set(events))} are gone")
        for step in plan:
            step_event = events[step.version]
            if step.base is None:
                await self._full(step_event, transport_of(step_event))
            else:
                await self._delta(step_event, transport_of(step_event))
        return self.copy

    async def _full(self, event: WeightVersionEvent, transport: WeightTransport) -> None:
        tensors = await fetch_full(transport, event)
        if transport.name == "filesystem":
            # Views of a read-only file mapping: deltas are applied onto a copy of our own.
            tensors = await asyncio.to_thread(lambda: {name: t.clone() for name, t in tensors.items()})
        self.copy, self.version, self.event_id = tensors, event.version, event.id

    async def _delta(self, event: WeightVersionEvent, transport: WeightTransport) -> None:
        assert event.base_version is not None
        if self.version != event.base_version:
            raise WeightsRefused(f"v{event.version} applies onto v{event.base_version}, the copy holds v{self.version}")
        payloads = [await transport.fetch_bytes(shard) for shard in event.shards]
        try:
            await asyncio.to_thread(
                apply_delta, self.copy, payloads, event.manifest, version=event.version, base_version=event.base_version
            )
        except WeightsRefused:
            # All or nothing: the copy is still the base, but it may not be this chain's base.
            self.copy, self.version = {}, None
            raise
        self.version, self.event_id = event.version, event.id
