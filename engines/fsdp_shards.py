"""Full tensors of an FSDP2 model gathered to one owner rank each, never to every rank.

FSDP2 keeps every parameter as a DTensor sharded on dim 0 (`Shard(0)`): rank r holds rows
[r*c, min((r+1)*c, d0)) of a parameter with d0 rows, c = ceil(d0 / world) (torch.chunk's
split: the last ranks may hold fewer rows, or none). To publish a weight version in shards
(`engines.delta_plan.assign_shards` says which rank publishes which tensor), each parameter
is gathered to its owner alone:

    every rank   local rows (r_k, *rest) -> padded to (c, *rest), on the CPU
    dist.gather  dst = owner: the owner receives world x (c, *rest), the others only send
    owner        each rank's rows trimmed to r_k, concatenated -> (d0, *rest), contiguous

Cost per parameter: one gather of world * c rows (at most world - 1 rows of padding), so a
rank receives only the tensors it owns (about 1/world of the model) and sends its 1/world
of every tensor: the model's bytes cross the group once, as with rank-0 export, but no rank
holds more than its share of full tensors. Every rank calls `gather_owned` with the same
arguments, in the same order (the gathers are collectives over the default process group).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def rows_of(rows: int, rank: int, world: int) -> int:
    """The dim-0 rows rank `rank` holds of a parameter with `rows` rows (torch.chunk's split)."""
    chunk = math.ceil(rows / world) if rows else 0
    return max(0, min(chunk, rows - rank * chunk))


def parameter_sizes(
    params: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None
) -> dict[str, int]:
    """Bytes of each full parameter (in `dtype`, default its own), from its global shape."""
    return {
        name: p.numel() * (torch.empty(0, dtype=dtype or p.dtype).element_size())
        for name, p in params.items()
    }


def gather_owned(
    params: Mapping[str, torch.Tensor], layout: Sequence[Sequence[str]], rank: int, world: int
) -> tuple[dict[str, torch.Tensor], int]:
    """(this rank's full CPU tensors: the names `layout[rank]` lists, in `params`' order;
    the bytes this rank received to build them, padding included).

    `params`: name -> FSDP2 parameter (a DTensor sharded on dim 0 over `world` ranks, or a
    plain tensor every rank holds whole: then the owner copies its own, nothing moves).
    `layout[r]`: the names rank r owns; every name of `params` is in exactly one of them.
    """
    owner = {name: r for r, names in enumerate(layout) for name in names}
    if set(owner) != set(params) or sum(len(names) for names in layout) != len(owner):
        raise ValueError(
            "the layout does not give each parameter one owner: "
            f"{sorted(set(owner) ^ set(params))[:3]}"
        )
    own: dict[str, torch.Tensor] = {}
    received = 0
    for name, param in params.items():
        dst = owner[name]
        if not isinstance(param, DTensor):
            if dst == rank:
                own[name] = param.detach().to("cpu", copy=True).contiguous()
            continue
        if tuple(param.placements) != (Shard(0),):
            raise ValueError(f"{name}: placements {param.placements}, expected one Shard(0)")
        rows = param.shape[0]
        chunk = math.ceil(rows / world)
        local = param.to_local().detach().to("cpu")
        if local.shape[0] != rows_of(rows, rank, world):
            raise ValueError(
                f"{name}: rank {rank} holds {local.shape[0]} rows, "
                f"expected {rows_of(rows, rank, world)}"
            )
        padded = torch.zeros((chunk, *local.shape[1:]), dtype=local.dtype)
        padded[: local.shape[0]] = local
        # Only the owner allocates the receive buffers: the other ranks never hold the tensor.
        pieces = [torch.empty_like(padded) for _ in range(world)] if dst == rank else None
        dist.gather(padded, pieces, dst=dst)
        if pieces is not None:
            received += sum(p.nbytes for p in pieces)
            own[name] = torch.cat(
                [p[: rows_of(rows, r, world)] for r, p in enumerate(pieces)]
            ).contiguous()
    return own, received
