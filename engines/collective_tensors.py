"""A collective broadcast as the engines' own weight-update calls receive it: one broadcast per
tensor, from group rank 0, in the plan's order, in the tensor's own dtype and shape.

`engines.collective` broadcasts in buckets (windows of one byte stream) when every member
receives into a staging buffer. When a member checks in as an engine (`engine:<ranks>`: it
takes the version into the engine's own memory, `engines.weights_group.GroupWeights`), the
attempt runs in *tensor mode* instead, for every member of it:

    check-in  "yes" (staging buffer, 1 rank) | "engine:N" (N ranks: the engine's TP ranks)
              | "no"
    start     mode "tensors" when any member is an engine; `ranks` {member: first group rank}
              (the source is rank 0; members follow in order, each taking its ranks), `size`,
              and `group`, the group's name (a new one per epoch)
    group     `weights_group.custom_group`, SGLang's `init_custom_process_group`: the source
              on the TCPStore it hosts, prefixed by the group's name; an engine joins through
              its own call with ``tcp://<source's address>``; a staging member as the source
    data      per slot: the source broadcasts the tensor; an engine receives it into a new
              tensor of that dtype and shape (its own call); a staging member into the slot's
              view of its staging buffer

Tensor mode needs one sender (the engines' calls take src 0): with several trainer ranks an
engine member declines (`no`) and catches up from the stored copy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engines.collective_plan import Slot

if TYPE_CHECKING:
    from engines.collective_group import CollectiveSettings
from engines.weights_group import bare_group

ENGINE = "engine:"
"""Prefix of an engine member's check-in; the number of group ranks it takes follows."""


def group_name(port: int, epoch: int) -> str:
    """The weight-update group of one epoch of the source listening on `port` (an engine keeps
    its groups by name: a restarted source's epochs do not reuse an old one's)."""
    return f"jetrl-weights-{port}-e{epoch}"


def ranks_of(answers: Mapping[str, str]) -> dict[str, int]:
    """Group ranks each member that said yes takes: 1 for a staging buffer, N for
    ``engine:N``; members that said no (or nothing) left out."""
    out: dict[str, int] = {}
    for member, answer in answers.items():
        if answer == "yes":
            out[member] = 1
        elif answer.startswith(ENGINE) and answer[len(ENGINE) :].isdigit():
            out[member] = max(1, int(answer[len(ENGINE) :]))
    return out


def start_of(epoch: int, ranks: Mapping[str, int], engines: bool, senders: int, port: int) -> dict:
    """The start record of an attempt whose members take `ranks` group ranks each."""
    offsets, at = {}, senders
    for member, n in ranks.items():
        offsets[member], at = at, at + n
    return {
        "epoch": epoch,
        "members": list(ranks),
        "ranks": offsets,
        "size": at,
        "mode": "tensors" if engines else "buckets",
        "group": group_name(port, epoch),
    }


def place(start: dict, member: str, senders: int) -> tuple[int, int]:
    """(this member's first group rank, group size) from the start record (records without
    `ranks`: every member one rank, after the senders)."""
    members = list(start["members"])
    if "ranks" in start:
        return int(start["ranks"][member]), int(start["size"])
    return senders + members.index(member), senders + len(members)


def open_tensor_group(
    store: dist.Store, rank: int, size: int, name: str, s: CollectiveSettings
) -> dist.ProcessGroupGloo | dist.ProcessGroupNCCL:
    """The epoch's group as the engines make theirs (`weights_group.bare_group` on `store`,
    prefixed by `name`): its backend object for `s.device`."""
    t = timedelta(seconds=s.join_timeout_s)
    backends = bare_group(dist.PrefixStore(name, store), rank, size, name, s.backend, t)
    return backends["cuda" if s.device.startswith("cuda") else "cpu"]


def send_tensors(
    slots: Sequence[Slot],
    tensors: Mapping[str, torch.Tensor],
    broadcast: Callable[[torch.Tensor], None],
    device: str,
) -> int:
    """The source's part of a tensor-mode attempt: each slot's tensor, in order, as it is
    (dtype and shape of the slot; moved to `device`). Returns the bytes sent."""
    sent = 0
    for name, dtype, shape, _, nbytes in slots:
        tensor = tensors[name].detach().to(device).contiguous()
        if str(tensor.dtype).removeprefix("torch.") != dtype or list(tensor.shape) != shape:
            raise ValueError(f"{name}: {tensor.dtype} {list(tensor.shape)}, planned {dtype}")
        broadcast(tensor)
        sent += nbytes
    return sent


def receive_tensors(
    slots: Sequence[Slot], staging: torch.Tensor, broadcast: Callable[[torch.Tensor], None]
) -> None:
    """A staging member's part of a tensor-mode attempt: each slot's broadcast into its view
    of `staging` (slots are 64-byte aligned, so each views as its dtype)."""
    for _, dtype, shape, offset, nbytes in slots:
        broadcast(staging[offset : offset + nbytes].view(getattr(torch, dtype)).view(shape))
