"""Delta weight versions: per tensor, only the elements whose bits changed since a base version.

One trainer rank encodes one shard (the tensors `engines.delta_plan.assign_shards` gives it)
into one safetensors payload; a worker applies every shard of a version onto its copy of the
base version, in place, and checks each result tensor against the sha256 the version's
manifest gives for it (`engines.weights.tensor_sha256`: the full result's raw bytes).

Per tensor, one of four encodings (the header says which):
- ``same``: no element changed; nothing is stored.
- ``sparse``: the changed positions as gaps (index minus previous index minus 1, in the
  narrowest unsigned dtype that holds them) then the change of each element, both zlib'd.
- ``dense``: the change of every element (0 where none), zlib'd; chosen when storing gaps
  would cost more than storing the zeros, e.g. a float32 tensor after an optimizer step.
- ``full``: the new tensor as is; chosen when the others are not smaller, when the base lacks
  the tensor or holds another dtype or shape, and for every tensor of a full version.

A change is the difference new - old of the elements' bit patterns read as ordered integers
(see `_ordered`): a bf16 value that moves by one ulp changes by +-1, also across zero, so the
changes fit in int8 and compress well. The difference wraps modulo 2**bits, so applying it is
exact for every bit pattern (NaN, -0.0, subnormals) and undoing it restores the base exactly.

Why zlib at level 1: on a 71 MB bf16 Qwen2 after one AdamW step at lr 1e-6 (fp32 master
weights, published as bf16: 4.2% of the elements change) the raw sparse form is 7.4% of the
full bytes, zlib-1 3.0%, zlib-6 2.75% at 6x the time; lzma on the XOR of the bits 3.8% at
15x the time, zlib-1 on the XOR 6.0%. zlib only sees the changes, so it costs little.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping, Sequence
from typing import Final, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load, save

from engines.weights import ChecksumMismatch, WeightsRefused, dtype_name, tensor_sha256
from schemas.weight_event import TensorSpec

FORMAT: Final = "jetrl-delta/1"
META_KEY = "jetrl.delta"
ZLIB_LEVEL = 1
# Raw-bit integer dtype by item size: the elements are compared and changed as these.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SIGNED = (np.int8, np.int16, np.int32, np.int64)
_UNSIGNED = (np.uint8, np.uint16, np.uint32, np.uint64)
Encoding = Literal["same", "sparse", "dense", "full"]


class TensorDelta(TensorSpec):
    """How one tensor of a shard is stored: the manifest entry of the tensor it rebuilds (name,
    dtype, shape and sha256 of the result), then its encoding."""

    encoding: Encoding
    """same | sparse | dense | full (see the module docstring)."""
    count: int = Field(0, ge=0)
    """Changed elements (sparse), or all elements (dense)."""
    gaps: Literal["uint8", "uint16", "uint32", "uint64"] = "uint8"
    """Dtype of the stored gaps (sparse)."""
    diffs: Literal["int8", "int16", "int32", "int64"] = "int8"
    """Dtype of the stored changes (sparse, dense)."""


class ShardHeader(BaseModel):
    """The safetensors metadata of one delta shard (JSON under `META_KEY`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["jetrl-delta/1"] = FORMAT
    version: int = Field(ge=0)
    """The version this shard rebuilds."""
    base_version: int | None = Field(None, ge=0)
    """The version it applies onto; None: a full version (every tensor `full`)."""
    rank: int = Field(ge=0)
    """The trainer rank that wrote it."""
    world: int = Field(ge=1)
    """The number of shards of the version."""
    tensors: tuple[TensorDelta, ...]


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A flat writable int view of `tensor`'s raw bits (shares its memory)."""
    return tensor.view(_BITS[tensor.element_size()]).numpy().reshape(-1)


def _ordered(bits: np.ndarray) -> np.ndarray:
    """Sign-magnitude bit patterns -> integers in float order; its own inverse.

    Negative floats have the sign bit set and grow in magnitude with the other bits:
    flipping those bits makes the int order the float order (-0.0 -> -1, +0.0 -> 0).
    """
    width = bits.dtype.itemsize * 8
    return bits ^ ((bits >> (width - 1)) & np.array(np.iinfo(bits.dtype).max, bits.dtype))


def _narrowest(values: np.ndarray, candidates: tuple[type[np.integer], ...]) -> np.ndarray:
    low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
    for dtype in candidates:
        if np.iinfo(dtype).min <= low and high <= np.iinfo(dtype).max:
            return values.astype(dtype, copy=False)
    raise AssertionError(f"no integer dtype holds {low}..{high}")


def _encode(
    old: torch.Tensor | None, new: torch.Tensor
) -> tuple[dict[str, object], torch.Tensor | None]:
    """(header fields, payload tensor or None) for one tensor."""
    full: tuple[dict[str, object], torch.Tensor | None] = ({"encoding": "full"}, new)
    if old is None or old.dtype != new.dtype or old.shape != new.shape or new.numel() == 0:
        return full
    old_bits, new_bits = _bits(old.contiguous()), _bits(new)
    where = np.flatnonzero(old_bits != new_bits)
    if where.size == 0:
        return {"encoding": "same"}, None
    # int wraps modulo 2**bits; the change fits in new's width whatever it is.
    changes = _narrowest(_ordered(new_bits[where]) - _ordered(old_bits[where]), _SIGNED)
    gaps = _narrowest(np.diff(where, prepend=-1) - 1, _UNSIGNED)
    if where.size * gaps.itemsize < (new_bits.size - where.size) * changes.itemsize:
        fields: dict[str, object] = {
            "encoding": "sparse",
            "count": int(where.size),
            "gaps": gaps.dtype.name,
        }
        raw = gaps.tobytes() + changes.tobytes()
    else:
        dense = (_ordered(new_bits) - _ordered(old_bits)).astype(changes.dtype)
        fields, raw = {"encoding": "dense", "count": int(new_bits.size)}, dense.tobytes()
    blob = zlib.compress(raw, ZLIB_LEVEL)
    if len(blob) >= new.nbytes:
        return full
    return {**fields, "diffs": changes.dtype.name}, torch.frombuffer(
        bytearray(blob), dtype=torch.uint8
    )


def encode_shard(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    names: Sequence[str],
    *,
    version: int,
    base_version: int | None,
    rank: int = 0,
    world: int = 1,
) -> tuple[bytes, tuple[TensorSpec, ...]]:
    """The payload of shard `rank`: the tensors `names` of `new`, as changes from `base`.

    `base` holds this rank's tensors of `base_version` (only those are read); with
    `base_version` None every tensor is stored whole (a full version in the same format).
    Returns the payload and the manifest entries of its result tensors (name, dtype,
    shape, sha256 of `new[name]`), for the version's event. Tensors are on the CPU.
    """
    entries, payload, specs = [], {}, []
    for name in names:
        tensor = new[name].contiguous()
        fields, stored = _encode(base.get(name) if base_version is not None else None, tensor)
        spec = TensorSpec(
            name=name,
            dtype=dtype_name(tensor),
            shape=tuple(tensor.shape),
            sha256=tensor_sha256(tensor),
        )
        entries.append(TensorDelta.model_validate({**spec.model_dump(), **fields}))
        specs.append(spec)
        if stored is not None:
            payload[name] = stored
    header = ShardHeader(
        version=version, base_version=base_version, rank=rank, world=world, tensors=tuple(entries)
    )
    return save(payload, metadata={META_KEY: header.model_dump_json()}), tuple(specs)


def read_shard(data: bytes) -> tuple[ShardHeader, dict[str, torch.Tensor]]:
    """The header and stored tensors of one shard payload; ChecksumMismatch if unreadable."""
    try:
        tensors = load(data)
        with_header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        header = ShardHeader.model_validate_json(with_header.get("__metadata__", {})[META_KEY])
    except (SafetensorError, ValueError, KeyError, TypeError) as exc:
        detail = (
            f"{exc.error_count()} header errors, first: {exc.errors()[0]['msg']}"
            if isinstance(exc, ValidationError)
            else exc
        )
        raise ChecksumMismatch(f"not a {FORMAT} shard: {detail}") from None
    stored = {t.name for t in header.tensors if t.encoding != "same"}
    if set(tensors) != stored:
        raise ChecksumMismatch(
            f"shard {header.rank}: stored tensors differ from its header: "
            f"{sorted(set(tensors) ^ stored)[:3]}"
        )
    return header, tensors


def _changes(
    header: ShardHeader, entry: TensorDelta, blob: torch.Tensor, size: int
) -> tuple[np.ndarray | None, np.ndarray]:
    """(positions or None for all, changes) of a sparse or dense entry, checked for size."""
    gaps_dtype, diffs_dtype = np.dtype(entry.gaps), np.dtype(entry.diffs)
    n_gaps = entry.count if entry.encoding == "sparse" else 0
    expected = n_gaps * gaps_dtype.itemsize + entry.count * diffs_dtype.itemsize
    mismatch = ChecksumMismatch(
        f"shard {header.rank}: tensor {entry.name}: changes do not match its header"
    )
    if entry.count > size or (entry.encoding == "dense" and entry.count != size):
        raise mismatch
    # Bounded: a corrupt or hostile blob cannot inflate past what the header announces,
    # which is at most 16 bytes per element of the tensor.
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(blob.numpy().tobytes(), expected + 1)
    except zlib.error as exc:
        raise ChecksumMismatch(
            f"shard {header.rank}: tensor {entry.name}: corrupt changes ({exc})"
        ) from None
    if len(raw) != expected or not inflate.eof:
        raise mismatch
    changes = np.frombuffer(raw, diffs_dtype, offset=n_gaps * gaps_dtype.itemsize)
    if entry.encoding == "dense":
        return None, changes
    where = np.cumsum(np.frombuffer(raw, gaps_dtype, count=n_gaps).astype(np.int64) + 1) - 1
    if where.size and where[-1] >= size:
        raise ChecksumMismatch(
            f"shard {header.rank}: tensor {entry.name}: a change lies past its {size} elements"
        )
    return where, changes


def _shift(bits: np.ndarray, where: np.ndarray | None, changes: np.ndarray, sign: int) -> None:
    """bits[where] moves by sign * changes in float order, in place (exact, wraps)."""
    index = slice(None) if where is None else where
    moved = _ordered(bits[index])
    if sign > 0:
        moved += changes.astype(bits.dtype)
    else:
        moved -= changes.astype(bits.dtype)
    bits[index] = _ordered(moved)


def apply_delta(
    weights: dict[str, torch.Tensor],
    shards: Sequence[bytes],
    manifest: Sequence[TensorSpec],
    *,
    version: int,
    base_version: int | None,
) -> None:
    """Turn `weights` (version `base_version`, CPU) into `version` in place: all or nothing.

    `shards` are every shard payload of the version, `manifest` its event's manifest (the
    checksums to trust: a shard's own header is checked against it). Each result tensor is
    hashed; on any mismatch every tensor already changed is restored bit for bit and
    ChecksumMismatch says which tensor failed. With `base_version` None (a full version)
    `weights` may start empty; its tensors are replaced, not written into.
    """
    parsed = [read_shard(data) for data in shards]
    _check_shards(parsed, manifest, version, base_version)
    names = {spec.name for spec in manifest}
    if (base_version is not None or weights) and set(weights) != names:
        raise WeightsRefused(
            f"base weights' names differ from v{version}'s manifest: "
            f"{sorted(set(weights) ^ names)[:3]}"
        )
    undo: list[tuple[str, torch.Tensor | None, np.ndarray | None, np.ndarray | None]] = []
    try:
        for header, stored in parsed:
            for entry in header.tensors:
                _apply_entry(weights, header, entry, stored.get(entry.name), undo)
    except BaseException:
        for name, replaced, where, changes in reversed(undo):
            if changes is not None:
                _shift(_bits(weights[name]), where, changes, -1)
            elif replaced is None:
                del weights[name]
            else:
                weights[name] = replaced
        raise


def _apply_entry(
    weights: dict[str, torch.Tensor],
    header: ShardHeader,
    entry: TensorDelta,
    stored: torch.Tensor | None,
    undo: list[tuple[str, torch.Tensor | None, np.ndarray | None, np.ndarray | None]],
) -> None:
    name = entry.name
    if entry.encoding == "full":
        assert stored is not None  # read_shard checked it
        if dtype_name(stored) != entry.dtype or tuple(stored.shape) != entry.shape:
            raise ChecksumMismatch(
                f"shard {header.rank}: tensor {name}: stored dtype or shape differs from its header"
            )
        undo.append((name, weights.get(name), None, None))
        weights[name] = stored
    else:
        tensor = weights[name]
        if (
            dtype_name(tensor) != entry.dtype
            or tuple(tensor.shape) != entry.shape
            or not tensor.is_contiguous()
        ):
            raise WeightsRefused(
                f"base tensor {name} is not a contiguous {entry.dtype} {list(entry.shape)}"
            )
        if entry.encoding != "same":
            assert stored is not None
            where, changes = _changes(header, entry, stored, tensor.numel())
            _shift(_bits(tensor), where, changes, +1)
            undo.append((name, None, where, changes))
    if tensor_sha256(weights[name]) != entry.sha256:
        raise ChecksumMismatch(
            f"tensor {name}: v{header.base_version} + delta does not give v{header.version}'s "
            "checksum (wrong base or corrupt delta); weights left at the base"
        )


def _check_shards(
    parsed: Sequence[tuple[ShardHeader, dict[str, torch.Tensor]]],
    manifest: Sequence[TensorSpec],
    version: int,
    base_version: int | None,
) -> None:
    """Refuse shards that are not exactly one version's, or disagree with its manifest."""
    ranks = sorted(header.rank for header, _ in parsed)
    worlds = {header.world for header, _ in parsed}
    if worlds != {len(parsed)} or ranks != list(range(len(parsed))):
        raise WeightsRefused(
            f"v{version}: shards of ranks {ranks} with world sizes {sorted(worlds)} are not one "
            "whole version"
        )
    for header, _ in parsed:
        if (header.version, header.base_version) != (version, base_version):
            raise WeightsRefused(
                f"shard {header.rank} is v{header.version} on base {header.base_version}, "
                f"expected v{version} on base {base_version}"
            )
        if base_version is None and any(t.encoding != "full" for t in header.tensors):
            raise WeightsRefused(f"shard {header.rank} of full version v{version} holds changes")
    expected = {spec.name: spec for spec in manifest}
    carried = [entry for header, _ in parsed for entry in header.tensors]
    names = [entry.name for entry in carried]
    if len(names) != len(set(names)) or set(names) != set(expected):
        raise WeightsRefused(
            f"v{version}: shards do not carry each manifest tensor once: "
            f"{sorted(set(names) ^ set(expected))[:3]}"
        )
    for entry in carried:
        spec = expected[entry.name]
        if (entry.dtype, entry.shape, entry.sha256) != (spec.dtype, spec.shape, spec.sha256):
            raise ChecksumMismatch(
                f"tensor {entry.name}: shard header disagrees with v{version}'s manifest"
            )
