"""The value model of `algorithm.advantage: gae` under the fsdp engine: `engines.critic.Critic`
sharded over the default process group's ranks like the policy (`engines.fsdp_units`).

The value model's decoder blocks and its root (embeddings, final norm, value head) are FSDP2
units with the policy's mixed-precision policy; its AdamW steps its own float32 shards. Each rank
takes the critic's passes over its own micro-batches, and what spans the step spans every rank:

    prepare      V_old per micro-batch; a rank with fewer micro-batches than the busiest runs
                 empty forwards (every rank joins each unit's gather); the whitening of the
                 advantages and the step's value statistics are sums all-reduced over ranks
    accumulate   gradient sync off on every pass but the update's last, as the policy's: one
                 reduce-scatter (a sum, `sum_reductions`) per update, not per micro-batch
    update       clipped by the norm of the whole gradient (`clip_grad_norm`), stepped together

So a step is the torch engine's critic step on the union of the ranks' micro-batches. The
checkpoint (the fsdp engine's DCP `_state`) holds the value model's and its AdamW's shards.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

from engines.critic import Critic, CriticConfig, PositionIds, ValueModel
from engines.fsdp_units import clip_grad_norm, shard, sum_reductions
from engines.protocols import MicroBatch


class FSDPCritic(Critic):
    """`Critic` sharded over the default process group (see the module docstring)."""

    def __init__(
        self,
        policy: torch.nn.Module,
        cfg: CriticConfig,
        device: torch.device,
        autocast: Callable[[], AbstractContextManager[Any]],
        positions: PositionIds,
        *,
        compute_dtype: torch.dtype,
        blocks: Collection[str],
    ) -> None:
        """`policy`: the loaded policy, not yet sharded, its weights real on every rank;
        `compute_dtype` and `blocks` (the classes of its transformer blocks): as the policy's."""
        self.compute_dtype, self.blocks = compute_dtype, blocks
        super().__init__(policy, cfg, device, autocast, positions)

    def _build(self, model: ValueModel) -> torch.nn.Module:
        # A whole copy on every rank, not the policy's meta device + rank 0 broadcast: with a
        # critic the engine already loads the policy whole on every rank (`_load_model`'s
        # `whole`), so each rank copies the same decoder from it and keeps its own shard, with
        # no communication and nothing to remap (the value model's names are not the policy's).
        # The cost is a whole float32 copy per rank while loading, freed once sharded.
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        shard(model, self.blocks, mesh, self.compute_dtype)
        model.to(self.device)
        sum_reductions(model)
        return model

    def _passes(self, micro_batches: Sequence[MicroBatch]) -> int:
        passes = torch.tensor([len(micro_batches)], dtype=torch.int64, device=self.device)
        dist.all_reduce(passes, op=dist.ReduceOp.MAX)
        return int(passes.item())

    def _all_sum(self, sums: list[float]) -> list[float]:
        # float64: these are sums of squares over a whole step's tokens.
        out = torch.tensor(sums, dtype=torch.float64, device=self.device)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return [float(x) for x in out.tolist()]

    def _before_backward(self, last: bool) -> None:
        model: Any = self.model  # an FSDPModule too, which typing cannot tell
        model.set_requires_gradient_sync(last)

    def _clip_grad_norm(self) -> torch.Tensor:
        return clip_grad_norm(self.model.parameters(), self.cfg.max_grad_norm)

    def sharded_state(self) -> dict[str, Any]:
        """This rank's shards of the value model and of its AdamW state, as DCP saves them."""
        return {
            "critic_model": get_model_state_dict(self.model),
            "critic_optimizer": get_optimizer_state_dict(self.model, self.optimizer),
        }

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        """Restores what `sharded_state` gave, once DCP has loaded it in place."""
        set_model_state_dict(self.model, state["critic_model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["critic_optimizer"])
