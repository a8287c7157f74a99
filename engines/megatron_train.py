"""Megatron-core train engine (`trainer.engine: megatron`): megatron's GPTModel built from the HF
checkpoint's config, tensor- and pipeline-parallel over the default process group,
trained with our loss.

NEVER RUN ON A GPU. Its pieces are tested on the CPU (`tests/test_megatron.py`): the config
translation and the weight mapping, and, where megatron-core is installed, this engine itself
against `TorchTrainEngine`, with a checkpoint resume, on one CPU rank and on two gloo ranks at
tensor parallel 2, on two at pipeline parallel 2 and on four at both (`tests/megatron_cpu_proc.py`),
and the built-in job with two trainer ranks at tensor parallel 2 and at pipeline parallel 2
(`tests/test_megatron_job.py`). On the CPU `megatron_patches.cpu_workarounds` patches
megatron-core's CUDA-only spots. What no test has run: CUDA, NCCL.

megatron-core is imported when the engine is built, never at module import: a run without
`jetrl[megatron]` does not need it. The layer spec is megatron's local one (plain torch
modules, no Transformer Engine, no fusions): it takes our [B, 1, T, T] masks, which rows with
padding on either side need.

One step is `TorchTrainEngine.train_step` (the same loss, accumulation and metrics): every
tensor-parallel rank takes the same micro-batches, so besides megatron's own layers only the
log-probs' vocabulary reductions and the grad norm cross ranks. The log-probs come from the
final hidden states, `logprob_chunk_tokens` positions at a time over each rank's vocabulary
columns, reduced over the tensor-parallel group (`engines.megatron_logprobs`); with
`logprob_chunk_tokens` 0 from the full logits, gathered over the vocabulary
(`parallel_output=False`). At pipeline parallel each rank holds one stage and an update's
passes run through megatron's schedule (`engines.megatron_pipeline`), the loss on the last
stage, from the full logits whatever `logprob_chunk_tokens` says.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from engines.algorithms.logprobs import scaled_logits
from engines.megatron_config import MegatronModelSpec, spec_from_hf
from engines.megatron_logprobs import final_hidden_states, vocab_parallel_chunked_logprobs
from engines.megatron_names import (
    hf_to_megatron,
    megatron_to_hf,
    merge,
    shard,
    stage_params,
    unstage_params,
)
from engines.megatron_patches import cpu_workarounds, no_cuda_copy, recompute_in_backward
from engines.megatron_pipeline import (
    broadcast_from_last,
    pipeline_update_passes,
    reduce_totals,
    stage_logprobs,
)
from engines.protocols import EngineUnavailable, MicroBatch
from engines.torch_train import TorchTrainEngine, _atomic_save, _rng_state, _set_rng_state


class MegatronNotInstalled(EngineUnavailable):
    """`trainer.engine: megatron` on a machine without megatron-core (one line: what to install)."""


class MegatronTrainEngine(TorchTrainEngine):
    """`TorchTrainEngine` whose model is megatron-core's GPTModel, cut over `tensor_parallel_size` x
    `pipeline_parallel_size` ranks (rank = pp_rank x tp + tp_rank, megatron's default order)."""

    name = "megatron"
    collective = True

    def __init__(
        self,
        model_dir: Path,
        *,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        """The default process group must hold exactly the tensor x pipeline parallel ranks (one
        model copy); with size 1 and no group, a one-rank group is made here."""
        try:
            from megatron.core import parallel_state
        except ImportError:
            raise MegatronNotInstalled(
                "trainer.engine megatron needs megatron-core: pip install 'jetrl[megatron]'"
            ) from None
        if getattr(kwargs.get("loss"), "kl_coef", 0.0) and kwargs.get("own_reference", True):
            raise ValueError(
                "megatron engine: a KL loss term needs reference log-probs: enable the reference "
                "stage (reference.enabled), since this engine holds no frozen copy"
            )
        if kwargs.get("critic") is not None:
            raise ValueError(
                "megatron engine: algorithm.advantage gae needs a value model, "
                "which it does not hold (use torch)"
            )
        self.tp, self.pp = tensor_parallel_size, pipeline_parallel_size
        copy = self.tp * self.pp
        device = torch.device(kwargs.get("device", "cpu"))
        if not dist.is_initialized():
            if copy != 1:
                raise RuntimeError(
                    f"megatron engine: {self.tp} x {self.pp} model-parallel ranks need the default "
                    "process group up"
                )
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        if dist.get_world_size() != copy:
            raise ValueError(
                f"megatron engine: {dist.get_world_size()} ranks, "
                f"tensor x pipeline parallel is {self.tp} x {self.pp} (no data parallel yet)"
            )
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp
            )
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.rank = dist.get_rank()  # within the copy: its checkpoint file; 0 exports the weights
        if device.type == "cpu":
            cpu_workarounds()
        if device.type == "cuda":
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            # Megatron's dropout RNG states (dropout is 0 here, but its attention forks them).
            model_parallel_cuda_manual_seed(kwargs.get("seed", 0))
        self.spec: MegatronModelSpec  # set by _wrap, which the base __init__ calls
        # `logprob_chunk_tokens` > 0: `_chunked_logprobs` below (one stage); 0, or pipeline
        # parallel: the full logits (`_token_logits`, `engines.megatron_pipeline`).
        super().__init__(model_dir, **kwargs)

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The HF model -> a GPTModel of the same shape holding this rank's cut of its weights."""
        import torch.nn.functional as F
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig

        self.spec = spec_from_hf(
            model.config, tensor_parallel_size=self.tp, pipeline_parallel_size=self.pp
        )
        first, last = self.pp_rank == 0, self.pp_rank == self.pp - 1
        # Pipeline: activations of any [T, B] cross stages (their shape sent first), float32;
        # our loss is already the step's mean, which megatron must not divide again.
        piped = (
            {
                "variable_seq_lengths": True,
                "batch_p2p_comm": False,
                "calculate_per_token_loss": True,
                "pipeline_dtype": torch.float32,
                # No experts here; megatron's check of the default MoE dispatcher refuses variable
                # lengths.
                "moe_token_dispatcher_type": "alltoall",
            }
            if self.pp > 1
            else {}
        )
        config = TransformerConfig(
            **self.spec.transformer_config_kwargs(),
            activation_func=F.silu,
            params_dtype=torch.float32,  # master weights float32; bfloat16 compute is autocast's
            # Random init is overwritten below; CPU init needs no CUDA RNG.
            use_cpu_initialization=True,
            # The fused kernels need CUDA extensions (apex, TE) and some take no arbitrary mask.
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
            **piped,
        )
        with no_cuda_copy(self.device.type == "cpu"):
            gpt = GPTModel(
                config=config,
                transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                # Logits gathered over the vocabulary: our loss takes all of it.
                parallel_output=False,
                pre_process=first,
                post_process=last,
                **self.spec.gpt_model_kwargs(),
            )
        full = hf_to_megatron({n: p.detach().cpu() for n, p in model.named_parameters()}, self.spec)
        staged = stage_params(full, self.spec, self.pp_rank)
        mine = {name: shard(name, tensor, self.tp_rank, self.tp) for name, tensor in staged.items()}
        missing, unexpected = gpt.load_state_dict(mine, strict=False)
        missing = [n for n in missing if not n.endswith("._extra_state")]
        if missing or unexpected:
            raise ValueError(
                f"megatron engine: GPTModel and the mapping disagree: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}"
            )
        if self.activation_checkpointing:
            for layer in gpt.decoder.layers:
                recompute_in_backward(layer)
        return gpt.to(self.device)

    def _chunked_logprobs(
        self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] ids -> ([B, T - 1] log-probs, [B, T - 1] entropies) from the final hidden
        states, `logprob_chunk_tokens` positions at a time over this rank's vocabulary columns,
        reduced over the tensor-parallel group (`engines.megatron_logprobs`). One stage only:
        at pipeline parallel the last stage takes the full logits in megatron's schedule."""
        with final_hidden_states(model):
            hidden = self._stage_forward(input_ids, attention_mask, model)  # [T, B, H]
        # [Vp / TP, H]: tied, the input embedding (the output layer allocates none); untied, the
        # output layer's own (GPTModel's `shared_embedding_or_output_weight` would give the
        # input embedding on a first stage whatever the tie). Module attributes type loosely.
        output_layer: Any = model.output_layer
        word_embeddings: Any = model.embedding.word_embeddings  # type: ignore[union-attr]
        head: torch.Tensor | None = output_layer.weight
        weight: torch.Tensor = head if head is not None else word_embeddings.weight
        return vocab_parallel_chunked_logprobs(
            hidden.transpose(0, 1)[:, :-1],  # [B, T - 1, H]: position t predicts token t + 1
            weight,
            input_ids[:, 1:],
            temperature=self.loss_config.temperature,
            chunk=self.logprob_chunk_tokens,
            vocab_size=self.spec.vocab_size,
            group=self.tp_group,
        )

    def _token_logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        model: torch.nn.Module | None = None,
    ) -> torch.Tensor:
        """[B, T] ids -> [B, T - 1, V] temperature-scaled logits
        (V: the HF vocabulary, pad cut off)."""
        logits = self._stage_forward(input_ids, attention_mask, model)  # [B, T, Vp]
        return scaled_logits(
            logits[:, :-1, : self.spec.vocab_size].float(), self.loss_config.temperature
        )

    def _stage_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        model: torch.nn.Module | None = None,
    ) -> torch.Tensor:
        """This stage's forward of [B, T] ids: [B, T, Vp] logits on the last stage (inside
        `final_hidden_states`: its [T, B, H] final hidden states), [T, B, H] activations on the
        others (a later stage takes its input from `set_input_tensor`)."""
        positions = (attention_mask.cumsum(-1) - 1).clamp(
            min=0
        )  # as the torch engine: padding does not shift RoPE
        length = input_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).triu(1)
        # [B, 1, T, T], True where a query may not look: the future, and padding keys.
        masked = causal[None, None] | (attention_mask[:, None, None, :] == 0)
        with self._autocast():
            return (self.model if model is None else model)(
                input_ids, positions, attention_mask=masked
            )

    def _clip_grad_norm(self) -> torch.Tensor:
        """Norm over the whole model: each rank's cut tensors summed over the tensor- and
        pipeline-parallel ranks, the norms (whole on every tensor rank, with equal gradients)
        and a tied embedding's last-stage copy counted once."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        self._sync_tied_embedding()
        params = [p for p in self.model.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in params:
            if param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False):
                squares += p.grad.detach().float().pow(2).sum()  # type: ignore[union-attr]
        if self.tp > 1:
            dist.all_reduce(squares, group=self.tp_group)
        if self.pp > 1:
            dist.all_reduce(squares, group=self.pp_group)
        norm = squares.sqrt()
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm)
        return norm.cpu()

    def _sync_tied_embedding(self) -> None:
        """A tied model cut into stages holds the embedding twice (first stage: input, last:
        output layer); both take the sum of the two gradients, so they stay equal."""
        if self.pp == 1 or not self.spec.tie_word_embeddings:
            return
        from megatron.core import parallel_state

        if not parallel_state.is_rank_in_embedding_group():
            return
        # nn.Module's attributes are typed Tensor | Module; GPTModel has this method.
        weight = self.model.shared_embedding_or_output_weight()  # type: ignore[operator]
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())

    # --- pipeline parallel: the torch engine's passes, run through megatron's schedule ------------

    @torch.no_grad()
    def token_limits(self) -> tuple[int, int | None]:
        """The spec's: GPTModel is no HF model."""
        return self.spec.vocab_size, self.spec.max_position_embeddings

    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.pp == 1:
            return super().logprobs(input_ids, attention_mask)
        mine = stage_logprobs(self, [(input_ids.to(self.device), attention_mask.to(self.device))])
        return broadcast_from_last(self, mine[0] if mine else None, input_ids.shape).cpu()

    @torch.no_grad()
    def _proximal(self, micro_batches: Sequence[MicroBatch]) -> list[torch.Tensor]:
        if self.pp == 1:
            return super()._proximal(micro_batches)
        # Used by the loss only, which runs on the last stage: the others keep placeholders.
        batches = [
            (b.input_ids.to(self.device), b.attention_mask.to(self.device)) for b in micro_batches
        ]
        return stage_logprobs(self, batches) or [
            torch.zeros(b.input_ids.shape) for b in micro_batches
        ]

    def _update(
        self,
        micro_batches: Sequence[MicroBatch],
        proximal: Sequence[torch.Tensor] | None,
        totals: dict[str, float],
        targets: Sequence[Any] | None = None,
    ) -> float | None:
        if self.pp == 1:
            return super()._update(micro_batches, proximal, totals, targets)
        denominator, passes = self._step_shape(micro_batches)
        if passes == 0:
            return None
        self.optimizer.zero_grad(set_to_none=True)
        pipeline_update_passes(self, micro_batches, proximal, totals, denominator)
        grad_norm = self._clip_grad_norm()
        if torch.isfinite(grad_norm):  # as the torch engine: a non-finite update is skipped
            self.optimizer.step()
        return float(grad_norm)

    def _reduce(self, totals: dict[str, float]) -> dict[str, float]:
        return reduce_totals(self, totals) if self.pp > 1 else totals

    def export_weights(self) -> dict[str, torch.Tensor]:
        """On the copy's rank 0, HF name -> full CPU tensor (tied weights once); {} on the others.

        Every rank must call it: each parameter's tensor-parallel cuts are gathered, one
        parameter at a time, then each stage's tensor rank 0 sends its stage to stage 0."""
        full: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():
            local = param.detach()
            if self.tp > 1:
                parts = [torch.empty_like(local) for _ in range(self.tp)]
                dist.all_gather(parts, local.contiguous(), group=self.tp_group)
                if self.tp_rank == 0:
                    full[name] = merge(name, [p.cpu() for p in parts])
            else:
                full[name] = local.to("cpu", copy=True)
        if self.pp > 1:
            stages: list[Any] = [None] * self.pp
            dist.all_gather_object(stages, full if self.tp_rank == 0 else {}, group=self.pp_group)
            full = unstage_params(stages, self.spec)
        return megatron_to_hf(full, self.spec) if self.rank == 0 else {}

    # --- checkpoints: one file per rank in a step directory, then rank 0's pointer (the commit) --

    def has_checkpoint(self, path: Path) -> bool:
        seen = torch.tensor([int(path.exists())], dtype=torch.int64, device=self.device)
        dist.all_reduce(seen)
        ranks = dist.get_world_size()
        if int(seen.item()) not in (0, ranks):
            raise ValueError(
                f"{path}: {int(seen.item())} of {ranks} ranks see a checkpoint; "
                "the directory must be shared"
            )
        return bool(seen.item())

    def save_checkpoint(
        self,
        path: Path,
        extra: dict[str, Any] | None = None,
        before_replace: Callable[[], None] | None = None,
    ) -> None:
        step_dir = path.with_name(f"{path.name}.d") / f"step-{self.step}"
        if self.rank == 0 and step_dir.exists():
            shutil.rmtree(step_dir)  # a save of this step that was killed before its commit
        dist.barrier()
        own = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "rng": _rng_state(),
            "extra": extra or {},
        }
        _atomic_save(own, step_dir / f"rank{self.rank}.pt")
        if before_replace is not None:
            before_replace()
        dist.barrier()
        if self.rank == 0:
            _atomic_save(
                {
                    "dir": step_dir.name,
                    "step": self.step,
                    "tensor_parallel_size": self.tp,
                    "pipeline_parallel_size": self.pp,
                    "model_dir": str(self.model_dir),  # what ops.export rebuilds the HF model from
                },
                path,
            )
            for old in step_dir.parent.iterdir():
                if old.name != step_dir.name:
                    shutil.rmtree(old, ignore_errors=True)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        pointer = torch.load(path, weights_only=True)
        written = (pointer["tensor_parallel_size"], pointer.get("pipeline_parallel_size", 1))
        if written != (self.tp, self.pp):
            raise ValueError(
                f"{path}: written at tensor x pipeline parallel {written[0]} x {written[1]}, "
                f"this run has {self.tp} x {self.pp}"
            )
        own = torch.load(
            path.with_name(f"{path.name}.d") / pointer["dir"] / f"rank{self.rank}.pt",
            map_location=self.device,
            weights_only=True,
        )
        self.model.load_state_dict(own["model"])
        self.optimizer.load_state_dict(own["optimizer"])
        self.step = own["step"]
        _set_rng_state(own["rng"])
        return own["extra"]
