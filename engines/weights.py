"""Weight versions as bytes: the manifest (sha256 per tensor), its checks, and safetensors.

Pure numerics, no bus: the transports (`consumers.weights`) move the bytes and call these.
A loader first checks the manifest against its model (`check_manifest`), then every tensor
against its manifest entry (`verify`, or `Receiver` while the bytes arrive); a version that
fails either is refused (reported, never loaded).
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import struct

import torch
from safetensors.torch import save

from schemas.weight_event import TensorSpec

# safetensors' dtype codes <-> the wire dtype names of `schemas.tensor.DType`.
_CODES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
}
_TORCH = {name: getattr(torch, name) for name in _CODES.values()}
_ITEMSIZE = {name: torch.empty(0, dtype=dtype).element_size() for name, dtype in _TORCH.items()}
HEADER_LIMIT = 100 << 20
"""Largest safetensors header accepted (safetensors' own limit): a forged length must not
make a reader wait for, or allocate, gigabytes of header."""


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
        shapes = sorted(
            name for name in set(announced) & set(expected) if announced[name] != expected[name]
        )
        raise WeightsRefused(
            f"manifest does not match the model: {len(names)} names differ {names[:3]}, "
            f"{len(shapes)} shapes differ {shapes[:3]}"
        )


def in_dtype(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The floating tensors cast to `dtype` (the published dtype), the others as they are; a
    tensor already in it is the same object (no copy). float32 masters -> bfloat16 halves the
    bytes of every version a bf16 rollout loads."""
    return {
        name: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
        for name, t in tensors.items()
    }


def dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def raw(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy when it is a contiguous CPU tensor."""
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    # An ndarray is a buffer; numpy's stubs declare that for Python 3.12+ only.
    return memoryview(flat.numpy())  # type: ignore[arg-type]


def tensor_sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(raw(tensor)).hexdigest()


def manifest_of(tensors: dict[str, torch.Tensor]) -> tuple[TensorSpec, ...]:
    """Name, dtype, shape and sha256 of every tensor, in the dict's order."""
    return tuple(
        TensorSpec(name=name, dtype=dtype_name(t), shape=tuple(t.shape), sha256=tensor_sha256(t))
        for name, t in tensors.items()
    )


def nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * _ITEMSIZE[spec.dtype]


def serialize(tensors: dict[str, torch.Tensor]) -> bytes:
    """The safetensors bytes of `tensors` (what the object store holds)."""
    return save(tensors)


def verify(tensors: dict[str, torch.Tensor], manifest: tuple[TensorSpec, ...]) -> None:
    """ChecksumMismatch unless `tensors` are exactly the manifest's: names, dtypes,
    shapes, sha256."""
    expected = {spec.name: spec for spec in manifest}
    if set(tensors) != set(expected):
        raise ChecksumMismatch(
            f"tensor names differ from the manifest: {sorted(set(tensors) ^ set(expected))[:5]}"
        )
    for name, tensor in tensors.items():
        spec = expected[name]
        if (
            tuple(tensor.shape) != spec.shape
            or dtype_name(tensor) != spec.dtype
            or tensor_sha256(tensor) != spec.sha256
        ):
            raise ChecksumMismatch(
                f"tensor {name} does not match its manifest entry (shape, dtype or sha256)"
            )


def byte_buffer(size: int) -> mmap.mmap:
    """`size` zeroed, writable bytes, their pages mapped in one call.

    Not `bytearray(size)`: it zeroes the bytes itself and then its pages fault in one at a
    time as they are first written; at 512 MiB, 0.33 s of a 0.75 s fetch (this machine),
    against 0.21 s mapped up front (MAP_POPULATE; Linux, else mapped on first write).
    Not numpy's huge pages either: 0.09 s alone, but a fetch of a 480 MiB model into them
    took 1.6 s against 0.8, when the kernel had to compact memory to find them.
    """
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, max(size, 1), flags=flags)


class Receiver:
    """A safetensors payload received in pieces into one preallocated buffer, each tensor's
    sha256 checked as its bytes come in, and the tensors handed out as views of the buffer.

    `write(offset, data)` copies a piece in (the receiving side, pieces in order);
    `verify_through(end)` hashes what arrived up to byte `end` and raises ChecksumMismatch at
    the first tensor whose last byte is in and whose digest is wrong, or at a header that
    does not describe exactly the manifest's tensors, back to back. The two may run on
    different threads (at most one of each at a time): they touch disjoint bytes, and a
    byte is hashed only after it was written. Nothing is copied twice and no piece is
    joined to another: the cost is linear in the size.

    Why not `safetensors.torch.load`: it takes the whole payload as `bytes` and copies every
    tensor out of it, so it cannot check tensors while the rest is still on the wire.
    """

    def __init__(self, manifest: tuple[TensorSpec, ...], total_bytes: int) -> None:
        self.manifest = {spec.name: spec for spec in manifest}
        self.total = total_bytes
        self.buffer = byte_buffer(total_bytes)
        self._view = memoryview(self.buffer)
        self.received = 0
        self.hashed = 0
        self._layout: list[tuple[int, int, TensorSpec]] | None = None
        """(start, end, spec) of every tensor in the buffer, by start;
        known once the header is in."""
        self._next = 0
        """Index in `_layout` of the tensor being hashed."""
        self._hash = hashlib.sha256()

    def write(self, offset: int, data: bytes | memoryview) -> None:
        end = offset + len(data)
        if offset != self.received or end > self.total:
            raise ChecksumMismatch(
                f"bytes {offset}..{end} out of order or past the announced {self.total}"
            )
        self._view[offset:end] = data
        self.received = end

    def verify_through(self, end: int) -> None:
        end = min(end, self.received)
        if self._layout is None:
            self._layout = self._parse_header(end)
            if self._layout is None:
                return  # the header is not all in yet
            self.hashed = self._layout[0][0] if self._layout else self.total
        while self._next < len(self._layout) and self.hashed < end:
            _, stop, spec = self._layout[self._next]
            upto = min(stop, end)
            self._hash.update(self._view[self.hashed : upto])
            self.hashed = upto
            if upto == stop:
                if self._hash.hexdigest() != spec.sha256:
                    raise ChecksumMismatch(
                        f"tensor {spec.name} does not match its manifest entry (sha256)"
                    )
                self._hash = hashlib.sha256()
                self._next += 1

    def _parse_header(self, end: int) -> list[tuple[int, int, TensorSpec]] | None:
        """The tensors' byte ranges from the header once it is in (None before), checked
        against the manifest: the same names, dtypes and shapes, back to back to the end."""
        if end < 8:
            return None
        (length,) = struct.unpack("<Q", self._view[:8])
        if length > min(HEADER_LIMIT, self.total - 8):
            raise ChecksumMismatch(
                f"not a safetensors payload: a header of {length} bytes in {self.total}"
            )
        if end < 8 + length:
            return None
        try:
            header = json.loads(bytes(self._view[8 : 8 + length]))
            entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
            ranges = sorted(
                (int(e["data_offsets"][0]), int(e["data_offsets"][1]), name)
                for name, e in entries.items()
            )
            codes = {
                name: (_CODES.get(e["dtype"]), tuple(e["shape"])) for name, e in entries.items()
            }
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
            raise ChecksumMismatch(
                f"not a safetensors payload: {type(exc).__name__} in its header"
            ) from None
        if set(entries) != set(self.manifest):
            raise ChecksumMismatch(
                "tensor names differ from the manifest: "
                f"{sorted(set(entries) ^ set(self.manifest))[:5]}"
            )
        layout, base, cursor = [], 8 + length, 0
        for start, stop, name in ranges:  # offsets within the data section
            spec = self.manifest[name]
            if (
                codes[name] != (spec.dtype, spec.shape)
                or start != cursor
                or stop - start != nbytes(spec)
            ):
                raise ChecksumMismatch(
                    f"tensor {name} does not match its manifest entry (dtype, shape or place)"
                )
            layout.append((base + start, base + stop, spec))
            cursor = stop
        if base + cursor != self.total:
            raise ChecksumMismatch(
                f"the payload is {self.total} bytes, its header describes {base + cursor}"
            )
        return layout

    def tensors(self) -> dict[str, torch.Tensor]:
        """The verified tensors, views of the buffer; ChecksumMismatch unless all arrived and
        matched."""
        self.verify_through(self.received)
        if self.received != self.total or self._layout is None or self._next != len(self._layout):
            raise ChecksumMismatch(
                f"{self.received} of {self.total} bytes arrived, not all verified"
            )
        return {spec.name: self._tensor(begin, spec) for begin, _, spec in self._layout}

    def _tensor(self, start: int, spec: TensorSpec) -> torch.Tensor:
        count = math.prod(spec.shape)
        if count == 0:
            return torch.empty(spec.shape, dtype=_TORCH[spec.dtype])
        view = torch.frombuffer(self.buffer, dtype=_TORCH[spec.dtype], count=count, offset=start)
        # safetensors aligns every tensor; a payload that does not gets a copy,
        # never a misaligned view.
        return (
            view.reshape(spec.shape)
            if start % _ITEMSIZE[spec.dtype] == 0
            else view.clone().reshape(spec.shape)
        )
