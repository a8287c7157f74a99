"""Weight versions through the run's JetStream object store, streamed in and checked as they come.

    publish: safetensors bytes -> object `v<version>-<token>.safetensors` in chunks of
             `weights.chunk_mib` (`bus.objects.put_object`) -> all but the `keep` versions
             stored last deleted (each trainer rank prunes after its own shard)
    fetch:   the object's metadata (its size must be the event's) -> one buffer of that size
             (`engines.weights.Receiver`) -> every chunk copied in as it arrives
             (`bus.objects.read_chunks`) while a verifier thread hashes what is in, tensor by
             tensor, against the manifest -> the tensors, views of the buffer

The first tensor whose bytes do not match ends the read at once. Each byte is copied in
once and hashed once; the verifier runs beside the reading (hashlib lets go of the GIL), so
a fetch costs about what reading the chunks costs.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import torch
from nats.js.api import ObjectInfo

from bus.connection import JetStream
from bus.objects import (
    ObjectCorrupt,
    ObjectMissing,
    ObjectStalled,
    delete_object,
    list_objects,
    object_info,
    put_object,
    read_chunks,
)
from consumers.weights.transport import Stored, WeightsMissing, WeightsUnavailable, to_delete
from engines.weight_retention import stale_payloads
from engines.weights import ChecksumMismatch, Receiver, WeightsRefused, serialize
from schemas.weight_event import TransportName, WeightShard, WeightVersionEvent

VERSION_OBJECT = re.compile(r"v(\d+)(?:-[0-9a-f]{8})?\.safetensors")
"""The objects this transport writes (and prunes); any other object in the bucket is left alone."""


def object_name(version: int) -> str:
    return f"v{version}-{secrets.token_hex(4)}.safetensors"


class ObjectStoreTransport:
    """Versions in object store `bucket`, the last `keep` stored kept."""

    name: ClassVar[TransportName] = "object_store"

    def __init__(
        self,
        js: JetStream,
        bucket: str,
        chunk_bytes: int = 2 << 20,
        keep: int = 3,
        stall_seconds: float = 10.0,
    ) -> None:
        self.js, self.bucket = js, bucket
        self.chunk_bytes, self.keep, self.stall_seconds = chunk_bytes, keep, stall_seconds
        # One thread, so that the hashing of one fetch runs in the order the chunks came.
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="weights-verify")

    async def publish(
        self, version: int, tensors: dict[str, torch.Tensor], pinned: Collection[str] = ()
    ) -> Stored:
        data = await asyncio.to_thread(serialize, tensors)
        return await self.publish_bytes(version, data, pinned)

    async def publish_bytes(
        self, version: int, data: bytes, pinned: Collection[str] = ()
    ) -> Stored:
        name = object_name(version)
        await put_object(self.js, self.bucket, name, data, self.chunk_bytes)
        await self.prune(name, pinned)
        return Stored(name, len(data))

    async def prune(self, written: str, pinned: Collection[str] = ()) -> None:
        """Keep `written`, `pinned` (a delta chain's versions) and the objects of the `keep - 1`
        versions stored last before it (`to_delete`: by the time in their metadata, a version
        being all its ranks' shards); delete the other versions."""
        version = VERSION_OBJECT.fullmatch(written)
        assert version is not None, written
        stored = [
            (info.name, int(match.group(1)), info.mtime or "")
            for info in await list_objects(self.js, self.bucket)
            if info.name != written
            and info.name not in pinned
            and (match := VERSION_OBJECT.fullmatch(info.name))
        ]
        for name in to_delete(stored, int(version.group(1)), self.keep):
            await delete_object(self.js, self.bucket, name)

    async def retain(self, kept: Collection[str], latest: int) -> list[str]:
        """Delete the version objects up to `latest` not named in `kept`
        (`engines.weight_retention.stale_payloads`); the names deleted."""
        stored = [
            (info.name, int(match.group(1)))
            for info in await list_objects(self.js, self.bucket)
            if (match := VERSION_OBJECT.fullmatch(info.name))
        ]
        doomed = stale_payloads(stored, kept, latest)
        for name in doomed:
            await delete_object(self.js, self.bucket, name)
        return doomed

    async def _info(self, location: str, total_bytes: int) -> ObjectInfo:
        try:
            info = await object_info(self.js, self.bucket, location)
        except ObjectMissing as exc:
            raise WeightsMissing(str(exc)) from None
        except ObjectCorrupt as exc:
            raise WeightsRefused(str(exc)) from None
        if info.size != total_bytes:
            raise ChecksumMismatch(
                f"object {location} holds {info.size} bytes, the event announced {total_bytes}"
            )
        return info

    async def fetch_bytes(self, shard: WeightShard) -> bytes:
        """A delta shard's payload, whole; its checks are the delta's own (`apply_delta`)."""
        info = await self._info(shard.location, shard.total_bytes)
        buffer = bytearray(info.size or 0)

        def arrived(offset: int, data: bytes) -> None:
            buffer[offset : offset + len(data)] = data

        await self._read(info, arrived)
        return bytes(buffer)

    async def _read(self, info: ObjectInfo, arrived: Callable[[int, bytes], None]) -> None:
        try:
            await read_chunks(self.js, self.bucket, info, arrived, self.stall_seconds)
        except ObjectMissing as exc:
            raise WeightsMissing(str(exc)) from None
        except ObjectCorrupt as exc:
            raise WeightsRefused(str(exc)) from None
        except ObjectStalled as exc:
            raise WeightsUnavailable(str(exc)) from None

    async def fetch(self, event: WeightVersionEvent) -> dict[str, torch.Tensor]:
        info = await self._info(event.location, event.total_bytes)
        receiver = Receiver(event.manifest, event.total_bytes)
        loop = asyncio.get_running_loop()
        checks: list[asyncio.Future[None]] = []

        def arrived(offset: int, data: bytes) -> None:
            for check in checks[-2:]:  # a mismatch found ends the read (the rest would be wasted)
                if check.done() and check.exception() is not None:
                    raise check.exception()  # type: ignore[misc]
            receiver.write(offset, data)
            checks.append(
                loop.run_in_executor(self._verifier, receiver.verify_through, offset + len(data))
            )

        try:
            await self._read(info, arrived)
        finally:
            # Every check ends before the buffer is given out or dropped; the first failure wins.
            results = await asyncio.gather(*checks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return await loop.run_in_executor(self._verifier, receiver.tensors)
