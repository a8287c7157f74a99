"""FSDP2 pieces the fsdp engine's policy (`engines.fsdp_train`) and its value model
(`engines.fsdp_critic`) share: how a model is cut into units, how their gradients reduce, and
how the global gradient norm is clipped.

    shard            each transformer block (a class HF names in `_no_split_modules`) a unit of
                     its own, gathered only while it computes; the rest (embeddings, tied LM
                     head or value head, final norm) in the root unit
    sum_reductions   gradients *summed* over ranks, not averaged: each rank's loss already
                     divides by the step's global denominator
    clip_grad_norm   the norm of the whole gradient (each rank's shard norm, reduced), so every
                     rank clips alike and skips a non-finite step alike
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def shard(
    model: torch.nn.Module, blocks: Collection[str], mesh: DeviceMesh, dtype: torch.dtype
) -> None:
    """`model` sharded in place over `mesh`: a unit per module whose class name is in `blocks`,
    then the root. `dtype` is the compute dtype: parameters gathered in it, gradients reduced in
    float32, the sharded master weights (what AdamW updates) float32."""
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def sum_reductions(model: torch.nn.Module) -> None:
    """Every unit of `model` reduces its gradients by a plain sum over ranks (divide factor 1)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clips the sharded gradients of `parameters` to `max_norm` by the norm of the whole
    gradient; that norm before clipping, a CPU scalar (0 when no rank ran a pass). Every rank
    calls it (the shard norms are all-reduced)."""
    params = [p for p in parameters if p.grad is not None]
    if not params:  # no rank ran a pass: nothing to clip, nothing to step
        return torch.zeros(())
    grads = cast(list[torch.Tensor], [p.grad for p in params])  # none is None (filtered above)
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(norm, DTensor):  # each rank's shard norm -> the norm of the whole gradient
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm.cpu()
