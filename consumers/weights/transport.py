"""The weight transport: how one version's bytes go from the trainer to the rollout workers.

One interface per data flow: the trainer `publish`es a version's tensors and gets back
where they are (`Stored`: what the `WeightVersionEvent` says), a rollout worker `fetch`es
them from the event, verified against the event's manifest before it sees a tensor. The
transports (`object_store`, `filesystem`) differ only in where the bytes live; the manifest
(sha256 per tensor) is made once, here, for all of them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import ClassVar, NamedTuple, Protocol

import torch

from engines.weights import WeightsRefused
from schemas.weight_event import TransportName, WeightShard, WeightVersionEvent


class WeightsMissing(WeightsRefused):
    """The version's bytes are not where its event says: deleted (pruned) or never stored."""


class WeightsUnavailable(Exception):
    """The bytes cannot be read now (the read stalled): nothing wrong with the version itself,
    but the worker keeps its weights and takes the next version that comes."""


class Stored(NamedTuple):
    """Where a published version is, as its `WeightVersionEvent` says."""

    location: str
    total_bytes: int


def to_delete(
    stored: Iterable[tuple[str, int, float | str]], written_version: int, keep: int
) -> list[str]:
    """Of the `stored` payloads (name, version, time stored) other than those just written and
    those pinned, the ones to delete: all but those of the `keep - 1` versions stored last.

    Counted in versions, not payloads: with several trainer ranks a version is one payload per
    rank (its shards), each written and pruned by its own rank; counting payloads would let a
    rank delete the other ranks' shards of versions it keeps of its own. The version just
    written is kept whole (the other ranks' shards of it, written before this one). Ordered by
    time, not version: a trainer resumed from an older checkpoint publishes lower versions,
    and those are what its events announce."""
    latest: dict[int, float | str] = {}
    for _, version, when in stored:
        latest[version] = max(latest.get(version, when), when)
    latest.pop(written_version, None)
    kept = set(sorted(latest, key=lambda v: latest[v])[len(latest) - min(keep - 1, len(latest)) :])
    return [
        name for name, version, _ in stored if version != written_version and version not in kept
    ]


class WeightTransport(Protocol):
    """Moves whole weight versions; one object per process, used by one task at a time."""

    name: ClassVar[TransportName]

    async def publish(
        self, version: int, tensors: dict[str, torch.Tensor], pinned: Collection[str] = ()
    ) -> Stored:
        """Store `tensors` (CPU, contiguous) as `version`, and delete versions older than the
        ones kept, never those at `pinned` locations (the delta chain in progress). The
        manifest is made beside it (`sender.publish_version`)."""
        ...

    async def publish_bytes(
        self, version: int, data: bytes, pinned: Collection[str] = ()
    ) -> Stored:
        """Store one delta shard's payload of `version`, kept and pruned as `publish` does."""
        ...

    async def retain(self, kept: Collection[str], latest: int) -> list[str]:
        """Delete the stored payloads of versions up to `latest` at no `kept` location (the
        sender's retention, after announcing `latest`); the locations deleted."""
        ...

    async def fetch_bytes(self, shard: WeightShard) -> bytes:
        """A delta shard's payload as stored (its size checked; `apply_delta` checks the rest)."""
        ...

    async def fetch(self, event: WeightVersionEvent) -> dict[str, torch.Tensor]:
        """The event's tensors, each checked against its manifest entry. WeightsRefused (its
        ChecksumMismatch, WeightsMissing) for bytes that must never be loaded;
        WeightsUnavailable when they cannot be read now."""
        ...


async def fetch_full(
    transport: WeightTransport, event: WeightVersionEvent
) -> dict[str, torch.Tensor]:
    """A full version's tensors: at `location`, or in each of its shards, every shard fetched as
    a full version of its own tensors (streamed and checked against their manifest entries)."""
    if (
        not event.shards or transport.name == "collective"
    ):  # a broadcast carries every shard's tensors
        return await transport.fetch(event)
    tensors: dict[str, torch.Tensor] = {}
    for shard in event.shards:
        names = set(shard.tensors)
        part = event.model_copy(
            update={
                "location": shard.location,
                "total_bytes": shard.total_bytes,
                "shards": (),
                "manifest": tuple(spec for spec in event.manifest if spec.name in names),
            }
        )
        tensors.update(await transport.fetch(part))
    return tensors
