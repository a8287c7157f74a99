"""The receiving end of a collective broadcast inside the engine: a weight-update group the
engine joins itself, as SGLang's and vLLM's own distributed weight-update calls do.

SGLang (0.5.23, ``python/sglang/srt/entrypoints/engine.py``): `Engine.init_weights_update_group(
master_address, master_port, rank_offset, world_size, group_name, backend)` has every
tensor-parallel rank of the engine (rank_offset + tp_rank) join a process group with the
trainer, made by `init_custom_process_group` (``python/sglang/srt/utils``): a ``tcp://``
rendezvous at master_address:master_port (rank 0 hosts the TCPStore, the others connect),
prefixed by group_name, then torch's `_new_process_group_helper`. `Engine.
update_weights_from_distributed(names, dtypes, shapes, group_name)` then receives one
broadcast per tensor, from group rank 0, in the order named, each into a new tensor of the
dtype and shape named, and hands them to the model's `load_weights`.

`custom_group` is that group, step for step, so that our source (rank 0, on the TCPStore it
already hosts for the control plane) and the engines meet in one group. `GroupWeights` is what
a rollout engine offers to take a version that way (`engines.collective_engine` drives it);
an engine without it receives into the worker's staging buffer and loads a copy, as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    BackendConfig,
    GroupName,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

Spec = tuple[str, str, Sequence[int]]
"""Per tensor: HF name, dtype (torch's name, "bfloat16"), shape; in broadcast order."""


def custom_group(
    backend: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta,
    init_method: str | None = None,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """A process group of its own beside (or without) the default one, made as SGLang's
    `init_custom_process_group` makes it: from `init_method` (``tcp://host:port``; rank 0 hosts
    the store) prefixed by `group_name`, or from a `store` already prefixed so. Registered with
    ranks 0..world_size-1, so that ``torch.distributed.broadcast(group=...)`` takes it."""
    if (store is None) == (init_method is None):
        raise ValueError("custom_group: give init_method or store, exactly one")
    if store is None:
        assert init_method is not None
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=GroupName(group_name),
        timeout=timeout,
    )  # fmt: skip
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def bare_group(
    store: dist.Store, rank: int, size: int, group_name: str, backend: str, timeout: timedelta
) -> dict[str, dist.ProcessGroupGloo | dist.ProcessGroupNCCL]:
    """The backend objects `custom_group` would make, by device, without registering a group:
    the same stores (`store` prefixed by the group's name, as a ``tcp://`` rendezvous leaves
    it, then ``<name>/`` and ``<device>/``, as torch's `_new_process_group_helper` nests them)
    and the same backends (torch's own device map: one object for every device when they name
    one backend, as gloo's cpu and cuda do; its sequence number set through the store, as
    torch sets it). Our source and staging members use this: nothing is registered under the
    group's name (an engine in the same process may register it: a process holds one rank of
    a named group), and dropping the objects closes their sockets."""
    prefix = PrefixStore(f"{group_name}/", store)
    out: dict[str, dist.ProcessGroupGloo | dist.ProcessGroupNCCL] = {}
    devices = BackendConfig(Backend(backend)).get_device_backend_map()
    for device, name in devices.items():
        at = PrefixStore(f"{device}/", prefix)
        made: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
        if name == Backend.GLOO:
            made = dist.ProcessGroupGloo(at, rank, size, timeout=timeout)
        elif name == Backend.NCCL:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            made = dist.ProcessGroupNCCL(at, rank, size, options)
        else:
            raise ValueError(f"weight-update groups use gloo or nccl, not {name}")
        made._set_sequence_number_for_group()  # rank 0 writes it, the others read it
        out[device] = made
        if len(set(devices.values())) == 1:  # one backend object serves every device
            out.update(dict.fromkeys(devices, made))
            break
    return out


def sha256_of(tensor: torch.Tensor) -> str:
    """The tensor's bytes' sha256, as a manifest has it (`engines.weights.tensor_sha256`; here
    without the schemas, so that the engines' modules import without them)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


@runtime_checkable
class GroupWeights(Protocol):
    """A rollout engine that receives a broadcast version into its own memory.

    `join_weights_group` and `receive_weights` are the engine's own calls (SGLang's
    `init_weights_update_group` / `update_weights_from_distributed`, or what the engine has in
    their place), run by every copy at once: a collective needs every rank of the group."""

    weight_ranks: int
    """Ranks the engine takes in a weight-update group (its tensor-parallel size)."""

    def join_weights_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join `group_name` (ranks rank_offset .. rank_offset + weight_ranks - 1) with the
        source at master_address:master_port; raises when the engine refuses or fails."""
        ...

    def receive_weights(
        self, specs: Sequence[Spec], group_name: str, checksums: Mapping[str, str], version: int
    ) -> None:
        """Receive one broadcast per spec, in order, from group rank 0, load them, read the load
        back against `checksums` (sha256 per name, as the engine can) and set `version`.
        `WeightsNotLoaded` when the read-back disagrees; any other error when the broadcast
        or the load failed."""
        ...

    def leave_weights_group(self, group_name: str) -> None:
        """Drop the group (a new epoch has another)."""
        ...
