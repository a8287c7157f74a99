"""The byte layout of one collective broadcast: where each tensor sits,
which rank sends each bucket.

Every trainer rank that takes part (a *sender*) owns some tensors
(`engines.delta_plan.assign_shards` with several FSDP ranks; all of them with one). The stream lays
the owners' tensors out one owner after another, each tensor aligned to 64 bytes, so that every
slice can be viewed as its dtype; buckets are windows of at most `bucket_bytes` that never cross
from one owner's region into the next, so each bucket has exactly one source rank:

    stream   | rank 0's tensors | rank 1's tensors | ...
    buckets  (0, lo, hi) (0, lo, hi) | (1, lo, hi) ...     (src, stream byte range)

The plan (slots + buckets) is written by the coordinating source and read by every other
participant, so all of them issue the same broadcasts, in the same order, with the same src.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

ALIGN = 64  # byte alignment of every tensor in the stream, so uint8 slices view as any dtype

Slot = tuple[
    str, str, list[int], int, int
]  # per tensor: name, dtype, shape, byte offset in the stream, bytes
Spec = tuple[str, str, Sequence[int]]  # per tensor: name, dtype (torch's name, "float32"), shape
Bucket = tuple[int, int, int]  # src (the sending rank), stream bytes [lo, hi)
Into = (
    torch.nn.Module | Mapping[str, torch.Tensor] | None
)  # a model (its state_dict) or a dict of tensors


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[Spec]:
    """The specs of `tensors`, in their order."""
    return [
        (name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in tensors.items()
    ]


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def layout(
    owned: Sequence[Sequence[Spec]], bucket_bytes: int
) -> tuple[list[Slot], int, list[Bucket]]:
    """(slots, stream bytes, buckets) for `owned[r]`: the specs of the tensors sender r owns."""
    slots: list[Slot] = []
    buckets: list[Bucket] = []
    offset = 0
    for src, specs in enumerate(owned):
        start = offset
        for name, dtype, shape in specs:
            nbytes = _nbytes(dtype, shape)
            slots.append((name, dtype, list(shape), offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        buckets += [
            (src, lo, min(lo + bucket_bytes, offset)) for lo in range(start, offset, bucket_bytes)
        ]
    return slots, offset, buckets


def pieces(slots: Sequence[Slot], lo: int, hi: int) -> list[tuple[int, int, int, int]]:
    """(slot index, offset in the tensor's bytes, offset in the bucket,
    length) for stream bytes [lo, hi)."""
    spans = ((i, off, max(off, lo), min(off + n, hi)) for i, (_, _, _, off, n) in enumerate(slots))
    return [(i, a - off, a - lo, b - a) for i, off, a, b in spans if a < b]


def sent_by(buckets: Sequence[Bucket]) -> dict[int, int]:
    """Stream bytes each src broadcasts (alignment padding included)."""
    out: dict[int, int] = {}
    for src, lo, hi in buckets:
        out[src] = out.get(src, 0) + hi - lo
    return out


def misfit(slots: Sequence[Slot], into: Into) -> str:
    """Why the version cannot load into `into` (names or shapes differ), or ""."""
    dest = into.state_dict() if isinstance(into, torch.nn.Module) else into
    shapes = {name: list(shape) for name, _, shape, _, _ in slots}
    if dest is not None and (
        set(shapes) != set(dest) or any(list(dest[n].shape) != shapes[n] for n in shapes)
    ):
        return (
            "the version does not match the model: names or shapes differ "
            f"({len(set(shapes) ^ set(dest))} names)"
        )
    return ""
