"""Weight versions through the run's JetStream object store: safetensors + sha256 per tensor.

The bytes never ride in a stream message; the `WeightVersionEvent` on `weights` says where
they are and carries the manifest. A loader recomputes every checksum and refuses a
payload that does not match (it is reported, never loaded).
"""

from __future__ import annotations

import hashlib

import torch
from nats.js import JetStreamContext
from safetensors.torch import load, save

from schemas.events import TensorSpec, WeightVersionEvent


class ChecksumMismatch(ValueError):
    """Weight bytes that do not match their manifest."""


def _sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def pack(tensors: dict[str, torch.Tensor]) -> tuple[bytes, tuple[TensorSpec, ...]]:
    manifest = tuple(
        TensorSpec(name=name, dtype=_dtype_name(t), shape=tuple(t.shape), sha256=_sha256(t)) for name, t in tensors.items()
    )
    return save(tensors), manifest


def unpack(data: bytes, manifest: tuple[TensorSpec, ...]) -> dict[str, torch.Tensor]:
    """Tensors from safetensors bytes, each checked against the manifest."""
    tensors = load(data)
    expected = {spec.name: spec for spec in manifest}
    if set(tensors) != set(expected):
        raise ChecksumMismatch(f"tensor names differ from the manifest: {sorted(set(tensors) ^ set(expected))[:5]}")
    for name, tensor in tensors.items():
        spec = expected[name]
        if tuple(tensor.shape) != spec.shape or _dtype_name(tensor) != spec.dtype or _sha256(tensor) != spec.sha256:
            raise ChecksumMismatch(f"tensor {name} does not match its manifest entry (shape, dtype or sha256)")
    return tensors


async def put_version(
    js: JetStreamContext, bucket: str, run: str, source: str, version: int, tensors: dict[str, torch.Tensor]
) -> WeightVersionEvent:
    """Store the weights of `version` and return the event that announces them."""
    data, manifest = pack(tensors)
    name = f"v{version}.safetensors"
    await (await js.object_store(bucket)).put(name, data)
    return WeightVersionEvent(
        id=f"{run}/weights/{version}", run=run, source=source, version=version, step=version,
        location=name, manifest=manifest, total_bytes=len(data),
    )


async def get_version(js: JetStreamContext, bucket: str, event: WeightVersionEvent) -> dict[str, torch.Tensor]:
    result = await (await js.object_store(bucket)).get(event.location)
    if result.data is None:
        raise ChecksumMismatch(f"object {event.location} is empty")
    return unpack(result.data, event.manifest)
