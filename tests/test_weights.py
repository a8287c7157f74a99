"""Weight versions through the object store: bit-exact round trip, tampering refused."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import torch
from nats.js import JetStreamContext

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.topology import Topology
from engines.weights import ChecksumMismatch, get_version, put_version
from schemas import WeightVersionEvent

# Bit patterns a float comparison would hide: -0.0, NaN (NaN != NaN), infinities, subnormals.
SPECIALS = [-0.0, float("nan"), float("inf"), -float("inf"), 1e-40]


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    embed = torch.randn(64, 32, generator=generator).to(torch.bfloat16)
    norm = torch.randn(32, generator=generator)
    embed[0, : len(SPECIALS)] = torch.tensor(SPECIALS).to(torch.bfloat16)
    norm[: len(SPECIALS)] = torch.tensor(SPECIALS)
    return {"model.embed_tokens.weight": embed, "model.norm.weight": norm}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def run_store(
    server: EmbeddedNats, topology: Topology, body: Callable[[JetStreamContext, WeightVersionEvent], Awaitable[None]]
) -> None:
    """Apply the run, put version 3 of `weights()`, and hand its event to `body`."""

    async def main() -> None:
        nc = await connect(server.url, "test-weights")
        try:
            js = nc.jetstream()
            await topology.apply(js)
            event = await put_version(js, topology.object_bucket, topology.run, "test", 3, weights())
            await body(js, event)
        finally:
            await nc.close()

    asyncio.run(main())


def test_untampered_version_round_trips_bit_exactly(nats_server: EmbeddedNats, topology: Topology) -> None:
    async def body(js: JetStreamContext, event: WeightVersionEvent) -> None:
        loaded = await get_version(js, topology.object_bucket, event)
        original = weights()
        assert sorted(loaded) == sorted(original)
        for name, tensor in original.items():
            assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
            assert torch.equal(bits(loaded[name]), bits(tensor)), name
        assert [spec.dtype for spec in event.manifest] == ["bfloat16", "float32"]

    run_store(nats_server, topology, body)


def test_bytes_changed_in_the_store_are_refused(nats_server: EmbeddedNats, topology: Topology) -> None:
    async def body(js: JetStreamContext, event: WeightVersionEvent) -> None:
        store = await js.object_store(topology.object_bucket)
        stored = bytearray((await store.get(event.location)).data or b"")
        stored[-1] ^= 0x01  # one bit of the last tensor's data: still a valid safetensors file
        await store.put(event.location, bytes(stored))
        with pytest.raises(ChecksumMismatch, match=r"tensor model\.\S+ does not match its manifest entry"):
            await get_version(js, topology.object_bucket, event)

    run_store(nats_server, topology, body)


def test_manifest_checksum_changed_is_refused(nats_server: EmbeddedNats, topology: Topology) -> None:
    async def body(js: JetStreamContext, event: WeightVersionEvent) -> None:
        first, *rest = event.manifest
        forged = first.model_copy(update={"sha256": "0" * 64})
        tampered = event.model_copy(update={"manifest": (forged, *rest)})
        with pytest.raises(ChecksumMismatch, match="tensor model.embed_tokens.weight does not match"):
            await get_version(js, topology.object_bucket, tampered)

    run_store(nats_server, topology, body)
