"""Weight versions through the run's JetStream object store: safetensors + sha256 per tensor.

The bytes never ride in a stream message; the `WeightVersionEvent` on `weights` says where
they are and carries the manifest. A loader first checks the manifest against its model
(`check_manifest`), then recomputes every checksum; a version that fails either, or whose
bytes are missing or unreadable, is refused (reported, never loaded).
"""

from __future__ import annotations

import hashlib

import torch
from nats.js import JetStreamContext
from nats.js.errors import (
    BadObjectMetaError,
    DigestMismatchError,
    InvalidObjectNameError,
    LinkIsABucketError,
    NotFoundError,
)
from safetensors import SafetensorError
from safetensors.torch import load, save

from schemas.events import TensorSpec, WeightVersionEvent


class WeightsRefused(ValueError):
    """A weight version that must not be loaded; the message says why."""


class ChecksumMismatch(WeightsRefused):
    """Weight bytes that do not match their manifest."""


def check_manifest(manifest: tuple[TensorSpec, ...], model: torch.nn.Module) -> None:
    """Refuse a manifest that does not name exactly `model`'s parameters, with their shapes.

    Checked before any byte is fetched. Dtypes may differ: a rollout engine may serve in
    bfloat16 what the trainer keeps in float32, and loading casts.
    """
    expected = {name: tuple(param.shape) for name, param in model.named_parameters()}
    announced = {spec.name: spec.shape for spec in manifest}
    if announced != expected:
        names = sorted(set(announced) ^ set(expected))
        shapes = sorted(name for name in set(announced) & set(expected) if announced[name] != expected[name])
        raise WeightsRefused(
            f"manifest does not match the model: {len(names)} names differ {names[:3]}, "
            f"{len(shapes)} shapes differ {shapes[:3]}"
        )


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
    try:
        tensors = load(data)
    except SafetensorError as exc:
        raise ChecksumMismatch(f"not a safetensors payload: {exc}") from None
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
    """The verified tensors of `event`; WeightsRefused when its bytes are missing or wrong."""
    try:
        result = await (await js.object_store(bucket)).get(event.location)
    except (NotFoundError, InvalidObjectNameError, BadObjectMetaError, LinkIsABucketError, DigestMismatchError) as exc:
        raise WeightsRefused(f"object {event.location!r}: {type(exc).__name__} {exc}".strip()) from None
    if result.data is None:
        raise ChecksumMismatch(f"object {event.location} is empty")
    return unpack(result.data, event.manifest)
