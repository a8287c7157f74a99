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

With `algorithm.advantage: gae` the value model is sharded and trained the same way, in the
same updates (`engines.fsdp_critic`), and checkpointed beside the policy.

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
from torch.distributed.fsdp import FSDPModule
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from engines.algorithms.losses import aggregation_count
from engines.critic import CRITIC_SUMS, CriticConfig
from engines.delta_plan import assign_shards
from engines.device import with_index
from engines.fsdp_critic import FSDPCritic
from engines.fsdp_shards import gather_owned, parameter_sizes
from engines.fsdp_units import clip_grad_norm, shard, sum_reductions
from engines.protocols import MicroBatch
from engines.torch_train import (
    METRIC_SUMS,
    TorchTrainEngine,
    _atomic_save,
    _positions,
    _rng_state,
    _set_rng_state,
    chunked_model_logprobs,
)


def init_group(
    store: dist.Store | None, rank: int, world_size: int, device: torch.device, timeout: float
) -> None:
    """The default process group: gloo on CPU, NCCL for CUDA tensors (gloo beside it for CPU ones).

    `store` None: torchrun's environment (`env://`: MASTER_ADDR, MASTER_PORT). `timeout` (s)
    bounds every collective: a rank whose peer died or hangs raises instead of waiting forever.
    """
    if device.type == "cuda":
        torch.cuda.set_device(with_index(device, torch.cuda.device_count()))
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
        init_method=None if store is not None else "env://",
    )


def unmade_buffers(model: torch.nn.Module) -> list[str]:
    """Non-persistent buffers (made at init, not in the checkpoint) that `remake_rotary` does
    not remake: a model built on the meta device would keep them uninitialised."""
    return [
        f"{name}.{buffer}" if name else buffer
        for name, module in model.named_modules()
        if not type(module).__name__.endswith("RotaryEmbedding")
        for buffer in getattr(module, "_non_persistent_buffers_set", ())
    ]


def remake_rotary(model: torch.nn.Module, device: torch.device) -> None:
    """Each rotary embedding made again on `device` from the model's config: its inverse
    frequencies are computed at init, and `to_empty` left them uninitialised."""
    config = getattr(model, "config", None)
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent = model.get_submodule(name.rpartition(".")[0])
            setattr(parent, name.rpartition(".")[2], type(module)(config).to(device))


class FSDPTrainEngine(TorchTrainEngine):
    """`TorchTrainEngine` sharded over the default process group's ranks."""

    name = "fsdp"
    collective = True

    def __init__(self, model_dir: Path, **kwargs: Any) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "FSDPTrainEngine needs the default process group (engines.fsdp_train.init_group)"
            )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.weight_shards = self.world_size
        """Every rank sends its own shard of a weight version (`export_own_weights`)."""
        self.gathered_bytes = 0
        """Bytes this rank received in its last `export_shard` (its own tensors' rows, padded)."""
        super().__init__(model_dir, **kwargs)

    def _load_model(self, model_dir: Path, whole: bool) -> PreTrainedModel:
        """The model built on the meta device (no memory), and on rank 0 only the checkpoint's
        weights, which `_wrap` sends each rank its shard of: n ranks of a node hold one copy of
        the weights, not n (8 ranks of an 8B model: 32 GB of CPU memory, not 256).

        Every rank loads the whole model when `whole` (the frozen reference copy lives whole on
        every rank; the critic copies its decoder from it, `engines.fsdp_critic`) or when the
        model has buffers made at init that `_wrap` cannot remake (only rotary embeddings')."""
        self.rank0_weights: dict[str, torch.Tensor] | None = None
        """Rank 0's full float32 weights until `_wrap` has sent every rank its shard ({} on the
        other ranks); None when every rank loaded the whole model."""
        if whole:
            return super()._load_model(model_dir, whole)
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if unmade_buffers(model):
            return super()._load_model(model_dir, whole)
        self.rank0_weights = (
            super()._load_model(model_dir, whole).state_dict() if self.rank == 0 else {}
        )
        return model

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Each transformer block a unit of its own (gathered only while it computes), the rest
        (embeddings, tied LM head, final norm) in the root unit. A model on the meta device is
        then made on the device and gets its shards from rank 0's weights."""
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        shard(model, _blocks(model), mesh, self.compute_dtype)
        if self.rank0_weights is None:
            model.to(self.device)
        else:
            model.to_empty(device=self.device)  # the shards' memory, uninitialised
            remake_rotary(model, self.device)
            set_model_state_dict(
                model,
                cast(dict[str, Any], self.rank0_weights),
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
            )
            self.rank0_weights = None
        sum_reductions(model)
        # The chunked log-probs read the output projection and call the decoder: inside the
        # root module's forward, where FSDP2 has gathered the root unit's shards (embeddings,
        # tied head, final norm) and hooks its backward; outside it they are shards.
        plain = model.forward

        def forward(*args: Any, chunked: tuple[float, int] | None = None, **kwargs: Any) -> Any:
            if chunked is None:
                return plain(*args, **kwargs)
            temperature, chunk = chunked
            logprobs, entropies = chunked_model_logprobs(
                model, kwargs["input_ids"], kwargs["attention_mask"], temperature, chunk
            )
            # Not views ([B, T - 1] each, cheap): FSDP2 hooks the outputs' backward, which an
            # in-place op on a view would bypass.
            return logprobs.clone(), entropies.clone()

        model.forward = forward
        return model

    def _make_critic(self, model: torch.nn.Module, cfg: CriticConfig) -> FSDPCritic:
        """The value model sharded like the policy (`engines.fsdp_critic`), from the policy as
        loaded: whole on every rank when there is a critic (`_load_model`'s `whole`)."""
        return FSDPCritic(
            model,
            cfg,
            self.device,
            self._autocast,
            _positions,
            compute_dtype=self.compute_dtype,
            blocks=_blocks(model),
        )

    def _chunked_logprobs(
        self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if model is not self.model:  # the frozen reference copy: whole on every rank
            return super()._chunked_logprobs(model, input_ids, attention_mask)
        chunked = (self.loss_config.temperature, self.logprob_chunk_tokens)
        out: tuple[torch.Tensor, torch.Tensor] = self.model(
            input_ids=input_ids, attention_mask=attention_mask, chunked=chunked
        )
        return out

    def _autocast(self) -> AbstractContextManager[Any]:
        # The mixed-precision policy casts; autocast on top would only add casts.
        return nullcontext()

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
        # The critic's grad norm is already the whole gradient's on every rank: not summed.
        names = [name for name in (*METRIC_SUMS, *CRITIC_SUMS) if name in totals]
        sums = torch.tensor(
            [totals[name] for name in names], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        return totals | dict(zip(names, sums.tolist(), strict=True))

    def _clip_grad_norm(self) -> torch.Tensor:
        return clip_grad_norm(self.model.parameters(), self.max_grad_norm)

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
    #   <path>                 the pointer: {"dir", "step", "world_size", "model_dir",
    #                          "critic"}, replaced atomically by rank 0 once every rank's part
    #                          is on disk (the commit)
    #   <path>.d/step-<N>/     DCP: each rank's model and AdamW shards (and the critic's, with
    #                          gae) + .metadata;
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
                {
                    "dir": step_dir.name,
                    "step": self.step,
                    "world_size": self.world_size,
                    "model_dir": str(self.model_dir),
                    "critic": self.critic is not None,
                },
                path,
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
        if self.critic is not None and not pointer.get("critic", False):
            raise ValueError(
                f"{path} holds no critic: a run without GAE cannot resume as "
                "algorithm.advantage gae"
            )
        step_dir = _steps(path) / pointer["dir"]
        state = self._state()
        dcp.load(state, checkpoint_id=step_dir)
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        if isinstance(self.critic, FSDPCritic):
            self.critic.load_sharded_state(state)
        own = torch.load(step_dir / f"rank{self.rank}.pt", weights_only=True)
        self.step = own["step"]
        _set_rng_state(own["rng"])
        return own["extra"]

    def _state(self) -> dict[str, Any]:
        """This rank's shards of the model and of the optimizer state (and of the critic's),
        as DCP saves and loads them."""
        state = {
            "model": get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
        }
        if isinstance(self.critic, FSDPCritic):
            state |= self.critic.sharded_state()
        return state


def _steps(path: Path) -> Path:
    return path.with_name(f"{path.name}.d")


def _blocks(model: torch.nn.Module) -> set[str]:
    """The class names of the model's transformer blocks (HF names them), each an FSDP unit."""
    return set(getattr(model, "_no_split_modules", None) or ())
