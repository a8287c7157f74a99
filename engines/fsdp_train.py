"""Data-parallel train engine: FSDP2 (`torch.distributed.fsdp.fully_shard`), one process per rank.

Each rank holds a 1/world shard of every parameter, of its gradient and of the AdamW moments;
a layer's full parameters exist only while it computes. Every rank trains on its own rows of
the step (`batches.<rank>`) and the ranks take the one optimizer step together, so the update
is the single-process engine's on the union of the ranks' micro-batches:

    _step_shape   all-reduce (sum) of the step's loss denominator, (max) of its micro-batch
                  count: the token-mean is over the tokens of *every* rank, and a rank with
                  fewer micro-batches runs empty passes so that the collectives line up
    passes        gradient sync off on every pass but the last (gradients accumulate
                  unsharded on each rank: one reduce-scatter per step, not per micro-batch)
    reduce        gradients are *summed* over ranks, not averaged (each rank's loss already
                  divides by the global denominator): divide factor 1, sum reductions
    clip          the global grad norm (a DTensor norm, reduced), so every rank clips alike
                  and skips a non-finite step alike
    metrics       the step's metric sums all-reduced: every rank reports the whole step

The default process group must be up before the engine is built (`init_group`; the trainer's
rendezvous in `consumers.trainer_dist`). Every method that communicates is called by every
rank in the same order: train_step, export_weights, export_shard, has_checkpoint,
save/load_checkpoint.

Weights out, two ways: `export_weights` gathers every full tensor to rank 0 (one rank
publishes, or a collective broadcast); `export_shard` gathers each tensor to the one rank
that publishes it (`engines.fsdp_shards`), so that every rank stores its own shard of a
version and none holds the whole model. `export_own_weights`, what a rank hands the weights
sender, is its shard with several ranks (`weight_shards`), else the whole model.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from engines.algorithms.losses import aggregation_count
from engines.delta_plan import assign_shards
from engines.fsdp_shards import gather_owned, parameter_sizes
from engines.protocols import MicroBatch
from engines.torch_train import (
    METRIC_SUMS,
    TorchTrainEngine,
    _atomic_save,
    _rng_state,
    _set_rng_state,
)


def init_group(
    store: dist.Store | None, rank: int, world_size: int, device: torch.device, timeout: float
) -> None:
    """The default process group: gloo on CPU, NCCL for CUDA tensors (gloo beside it for CPU ones).

    `store` None: torchrun's environment (`env://`: MASTER_ADDR, MASTER_PORT). `timeout` (s)
    bounds every collective: a rank whose peer died or hangs raises instead of waiting forever.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
        init_method=None if store is not None else "env://",
    )


class FSDPTrainEngine(TorchTrainEngine):
    """`TorchTrainEngine` sharded over the default process group's ranks."""

    name = "fsdp"
    collective = True

    def __init__(self, model_dir: Path, **kwargs: Any) -> None:
        if kwargs.get("critic") is not None:
            raise ValueError(
                "fsdp engine: algorithm.advantage gae needs a value model, "
                "which it does not shard yet (use torch)"
            )
        if not dist.is_initialized():
            raise RuntimeError(
                "FSDPTrainEngine needs the default process group (engines.fsdp_train.init_group)"
            )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.weight_shards = self.world_size
        """Every rank sends its own shard of a weight version (`export_own_weights`)."""
        self.gathered_bytes = 0
        """Bytes this rank received in its last `export_shard` (its own tensors' rows, padded)."""
        # Full logits: the chunked log-probs read the output projection and call the decoder
        # outside the root module's forward, where FSDP2 has not gathered their shards.
        super().__init__(model_dir, **{**kwargs, "logprob_chunk_tokens": 0})

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Each transformer block a unit of its own (gathered only while it computes), the rest
        (embeddings, tied LM head, final norm) in the root unit."""
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        # bfloat16 compute: parameters gathered in bf16, gradients reduced in float32, the
        # sharded master weights (what AdamW updates) float32.
        policy = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        blocks = set(
            getattr(model, "_no_split_modules", None) or ()
        )  # HF names its blocks' classes
        for module in list(model.modules()):
            if type(module).__name__ in blocks:
                fully_shard(module, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(
                    True
                )  # a plain SUM: gloo has no PREMUL_SUM
        return model

    def _autocast(self) -> AbstractContextManager[Any]:
        return (
            nullcontext()
        )  # the mixed-precision policy casts; autocast on top would only add casts

    def _step_shape(self, micro_batches: Sequence[MicroBatch]) -> tuple[int, int]:
        mode = self.loss_config.aggregation
        local = sum(aggregation_count(mb.loss_mask, mode) for mb in micro_batches)
        denominator = torch.tensor([local], dtype=torch.int64, device=self.device)
        passes = torch.tensor([len(micro_batches)], dtype=torch.int64, device=self.device)
        dist.all_reduce(denominator, op=dist.ReduceOp.SUM)
        dist.all_reduce(passes, op=dist.ReduceOp.MAX)
        return int(denominator.item()), int(passes.item())

    def _before_backward(self, last: bool) -> None:
        model: Any = self.model  # an FSDPModule too, which typing cannot tell
        model.set_requires_gradient_sync(last)

    def _reduce(self, totals: dict[str, float]) -> dict[str, float]:
        sums = torch.tensor(
            [totals[name] for name in METRIC_SUMS], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        return dict(zip(METRIC_SUMS, sums.tolist(), strict=True))

    def _clip_grad_norm(self) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:  # no rank ran a pass: nothing to clip, nothing to step
            return torch.zeros(())
        grads = cast(list[torch.Tensor], [p.grad for p in params])  # none is None (filtered above)
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):  # each rank's shard norm -> the norm of the whole gradient
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm)
        return norm.cpu()

    def export_weights(self) -> dict[str, torch.Tensor]:
        """On rank 0, parameter name -> full CPU tensor (tied weights once); {} on the others.

        Gathered one tensor at a time (`cpu_offload`: only rank 0 keeps each one, copied to
        CPU), so no other rank ever holds more than one full parameter, and rank 0's device
        never holds more than its shard plus one full parameter. Every rank must call it.
        """
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # A model's state dict holds tensors only; the return type covers optimizer state too.
        full = cast(dict[str, torch.Tensor], get_model_state_dict(self.model, options=options))
        if self.rank != 0:
            return {}
        names = [name for name, _ in self.model.named_parameters()]
        # One rank: the "gathered" tensor can be the parameter's own storage; copy it, so an
        # optimizer step cannot change a version being published.
        return {
            name: full[name].clone() if self.world_size == 1 else full[name].contiguous()
            for name in names
        }

    def export_own_weights(self) -> dict[str, torch.Tensor]:
        """This rank's shard of a weight version (`assign_shards`: the same layout on every
        rank); with one rank, every tensor. Every rank must call it."""
        if self.world_size == 1:
            return self.export_weights()
        return self.export_shard(assign_shards(self.weight_sizes(), self.world_size))

    def weight_sizes(self) -> dict[str, int]:
        """Bytes of each full parameter as exported (tied weights once): what
        `engines.delta_plan.assign_shards` balances the ranks' shards by."""
        return parameter_sizes(dict(self.model.named_parameters()))

    def export_shard(self, layout: Sequence[Sequence[str]]) -> dict[str, torch.Tensor]:
        """This rank's full CPU tensors, `layout[rank]`, each gathered to this rank alone
        (the same bits `export_weights` gives for them). Every rank must call it, with the same
        `layout` (every parameter name in one of its entries); `gathered_bytes` says what this
        rank received."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()  # the root may still hold full parameters after a forward
        own, self.gathered_bytes = gather_owned(
            dict(self.model.named_parameters()), layout, self.rank, self.world_size
        )
        return own

    # --- checkpoints -------------------------------------------------------------------------
    #
    #   <path>                 the pointer: {"dir", "step", "world_size"}, replaced atomically
    #                          by rank 0 once every rank's part is on disk (the commit)
    #   <path>.d/step-<N>/     DCP: each rank's model and AdamW shards + .metadata;
    #                          rank<K>.pt: rank K's step, RNG states and `extra` (its last_seq)
    #
    # A save killed before the commit leaves the last committed step as it was; its half-written
    # directory is replaced by the next save of that step, or removed at the next commit.

    def has_checkpoint(self, path: Path) -> bool:
        """Whether a committed checkpoint is at `path`; every rank must see the same answer (a
        checkpoint directory that is not shared between the ranks' nodes is a ValueError)."""
        seen = torch.tensor([int(path.exists())], dtype=torch.int64, device=self.device)
        dist.all_reduce(seen, op=dist.ReduceOp.SUM)
        if int(seen.item()) not in (0, self.world_size):
            raise ValueError(
                f"{path}: {int(seen.item())} of {self.world_size} trainer ranks see a checkpoint; "
                "trainer.checkpoint_dir must be one directory every rank shares"
            )
        return bool(seen.item())

    def save_checkpoint(
        self,
        path: Path,
        extra: dict[str, Any] | None = None,
        before_replace: Callable[[], None] | None = None,
    ) -> None:
        """Model and optimizer shards (DCP), each rank's step, RNG and `extra`, then the commit.

        `before_replace` is called on every rank once its part is written and synced, before
        rank 0 commits (a kill there leaves the previous checkpoint in force). Every rank returns
        only once rank 0 has committed: what a rank then deletes (the batches the previous
        checkpoint needed) is no longer needed by any checkpoint in force."""
        step_dir = _steps(path) / f"step-{self.step}"
        if self.rank == 0 and step_dir.exists():
            shutil.rmtree(step_dir)  # a save of this step that was killed before its commit
        dist.barrier()
        dcp.save(self._state(), checkpoint_id=step_dir)
        own = {"step": self.step, "rng": _rng_state(), "extra": extra or {}}
        _atomic_save(own, step_dir / f"rank{self.rank}.pt")
        if before_replace is not None:
            before_replace()
        dist.barrier()  # every rank's part is on disk
        if self.rank == 0:
            _atomic_save(
                {"dir": step_dir.name, "step": self.step, "world_size": self.world_size}, path
            )
            for old in _steps(path).iterdir():
                if old.name != step_dir.name:
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier()  # committed

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restores the committed step; returns this rank's `extra`."""
        pointer = torch.load(path, weights_only=True)
        if pointer["world_size"] != self.world_size:
            raise ValueError(
                f"{path}: written by {pointer['world_size']} trainer ranks, "
                f"this run has {self.world_size}"
            )
        step_dir = _steps(path) / pointer["dir"]
        state = self._state()
        dcp.load(state, checkpoint_id=step_dir)
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        own = torch.load(step_dir / f"rank{self.rank}.pt", weights_only=True)
        self.step = own["step"]
        _set_rng_state(own["rng"])
        return own["extra"]

    def _state(self) -> dict[str, Any]:
        """This rank's shards of the model and of the optimizer state,
        as DCP saves and loads them."""
        return {
            "model": get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
        }


def _steps(path: Path) -> Path:
    return path.with_name(f"{path.name}.d")
