"""Where a worker's model runs and in what precision.

The device of a worker is chosen per process, not per run: a fleet hands each worker its
GPU(s) through CUDA_VISIBLE_DEVICES, and a role may pin its device in the fleet file
(`RoleConfig.device`), which reaches the worker as the environment variable below.

    JETRL_DEVICE unset or "auto"   the first visible GPU (cuda:LOCAL_RANK under torchrun), else
                                   the CPU
    JETRL_DEVICE = cpu | cuda | cuda:N   that device
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # torch is imported where a device is resolved: the fleet reads DEVICE_ENV only
    import torch

DEVICE_ENV = "JETRL_DEVICE"
"""The variable a fleet sets from a role's `device` (consumers.fleet_config.RoleConfig)."""

DTypeName = Literal["float32", "bfloat16"]


def torch_dtype(name: DTypeName) -> torch.dtype:
    """A `model.dtype` name as a torch dtype."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def resolve_device(setting: str | None = None) -> torch.device:
    """The device this process computes on: `setting`, else $JETRL_DEVICE, else auto.

    A named device that does not exist here (cuda with no GPU) is a ValueError with one line,
    not a late CUDA error inside the first step.
    """
    import torch

    name = (setting or os.environ.get(DEVICE_ENV) or "auto").strip()
    if name == "auto":
        if torch.cuda.is_available():
            return with_index(torch.device("cuda"), torch.cuda.device_count())
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(
            f"{DEVICE_ENV}={name!r}: not a device (auto, cpu, cuda or cuda:N)"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{DEVICE_ENV}={name!r}: no CUDA device is visible to this process")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={name!r}: only cpu and cuda are supported")
    return with_index(device, torch.cuda.device_count()) if device.type == "cuda" else device


def with_index(device: torch.device, visible: int) -> torch.device:
    """`cuda` without an index -> cuda:(LOCAL_RANK mod the `visible` GPUs); others unchanged.

    `torch.cuda.set_device` and NCCL refuse a bare `cuda` (the first GPU run of the fsdp engine
    stopped on "Expected a torch.device with a specified index"), and under torchrun each rank
    must take its own GPU, not all the first one.
    """
    import torch

    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(visible, 1))


def autocast(device: torch.device, dtype: torch.dtype) -> torch.autocast:
    """Mixed precision around a forward: matmuls in `dtype`, float32 master weights untouched.

    Disabled (a no-op context) for float32.
    """
    import torch

    return torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32)
