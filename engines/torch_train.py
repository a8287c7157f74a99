"""Reference train engine: one HF causal LM, AdamW, plain torch (CPU or one GPU).

One `train_step` = gradient accumulation over the step's micro-batches + one optimizer
step, so the policy version equals `step`. The loss is normalised by the token (or
sequence) count of the *whole step*, so splitting a batch into micro-batches does not
change the gradient.

Colocated with `trainer.offload_optimizer`, the optimizer state (AdamW's moments and step
counters, the critic's too) leaves the device between the trainer's turns and comes back
before its next step (`release_optimizer` / `resume_optimizer`, `engines.release.Offload`).
"""

import copy
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from engines.algorithms.logprobs import chunked_logprobs, scaled_logits
from engines.algorithms.losses import (
    aggregate,
    aggregation_count,
    entropy_from_logits,
    gather_logprobs,
)
from engines.algorithms.objective import (
    METRIC_SUMS,
    LossConfig,
    TokenObjective,
    token_objective,
)
from engines.checkpoint_io import atomic_save as _atomic_save
from engines.checkpoint_io import rng_state as _rng_state
from engines.checkpoint_io import seed_everything as _seed_everything
from engines.checkpoint_io import set_rng_state as _set_rng_state
from engines.critic import CRITIC_SUMS, Critic, CriticConfig, Targets
from engines.device import autocast
from engines.protocols import MicroBatch, empty_pass
from engines.release import Offload, optimizer_state

__all__ = [
    "METRIC_SUMS",
    "CriticConfig",
    "LossConfig",
    "TorchTrainEngine",
    "_atomic_save",
    "_rng_state",
    "_set_rng_state",
]


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] position ids counting real tokens only, so a row's padding (left or right) does
    not shift RoPE."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def chunked_model_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    chunk: int,
    compute: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A HF causal LM's [B, T - 1] log-probs of tokens 1..T-1 and the entropies of their
    predicting distributions, from the final hidden states [B, T - 1, H] and the output
    projection [V, H], `chunk` positions at a time: never the [B, T - 1, V] logits. `compute`:
    the context of the decoder's forward (the engine's autocast); the projection runs in
    float32 outside it."""
    with compute():
        # nn.Module's attributes are typed Tensor | Module; a HF model has these methods.
        hidden = model.get_decoder()(  # type: ignore[operator]
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=_positions(attention_mask),
        ).last_hidden_state[:, :-1]  # [B, T - 1, H]: position t predicts token t + 1
    head = model.get_output_embeddings().weight  # type: ignore[operator]  # [V, H]
    return chunked_logprobs(hidden, head, input_ids[:, 1:], temperature, chunk)


def _aligned(per_target: torch.Tensor) -> torch.Tensor:
    """[B, T - 1] values of the tokens 1..T-1 -> [B, T], 0 at t = 0 (nothing predicts it)."""
    return torch.nn.functional.pad(per_target, (1, 0))


class TorchTrainEngine:
    """Holds the policy, AdamW and the step counter; checkpoints them atomically.

    The hooks a data-parallel engine overrides (`engines.fsdp_train`): `_wrap` (shard the
    model), `_step_shape` (the step's denominator and pass count over every rank),
    `_before_backward` (when gradients sync), `_reduce` (metric sums over the ranks),
    `_clip_grad_norm`, `_autocast`, and the export and checkpoint methods.
    """

    name = "torch"
    """What the trainer reports as its engine (membership)."""
    collective = False
    """True when every rank must call `export_weights`, `has_checkpoint`, `save_checkpoint` and
    `load_checkpoint` together (they communicate); here each rank is on its own."""
    weight_shards = 1
    """Ranks that each send a shard of a weight version: one, rank 0 sends all of it."""

    def __init__(
        self,
        model_dir: Path,
        *,
        lr: float,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        seed: int = 0,
        loss: LossConfig = LossConfig(),
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        logprob_chunk_tokens: int = 1024,
        lr_schedule: Callable[[int], float] | None = None,
        ppo_epochs: int = 1,
        ppo_mini_batches: int = 1,
        own_reference: bool = True,
        critic: CriticConfig | None = None,
        activation_checkpointing: bool = False,
    ) -> None:
        """`dtype` is the compute dtype of forward and backward (bfloat16: autocast); the
        master weights and the AdamW moments stay float32, which they need the precision of.
        `logprob_chunk_tokens`: positions projected onto the vocabulary at once when taking
        log-probs from the final hidden states (`engines.algorithms.logprobs`); 0: the full
        [B, T, V] logits. `lr_schedule`: step -> multiplier of `lr` (`engines.algorithms.schedule`).
        `ppo_epochs` x `ppo_mini_batches` optimizer updates per `train_step` (the step's
        micro-batches split into that many contiguous mini-batches, each pass over them an
        epoch); the version still advances by one per step. With `loss.kl_coef` and `own_reference`
        a frozen copy of the initial model is held as the reference policy (on every rank: it is
        not sharded); without `own_reference` the batches bring the reference log-probs.
        `critic`: GAE with a value model (`engines.critic`), copied from the initial policy and
        trained in the same updates; the micro-batches' advantages are then outcome scores.
        `activation_checkpointing`: each transformer block recomputed in backward
        (`trainer.activation_checkpointing`)."""
        _seed_everything(seed)
        self.model_dir = Path(model_dir).resolve()
        """What the model was loaded from (config, tokenizer): each checkpoint records it for
        `ops.export`."""
        self.device = torch.device(device)
        self.compute_dtype = dtype
        model = self._load_model(
            model_dir, whole=bool(loss.kl_coef and own_reference) or critic is not None
        )
        self.reference: torch.nn.Module | None = None
        if loss.kl_coef and own_reference:
            # transformers types `to` through a decorator that mypy reads as unbound.
            self.reference = copy.deepcopy(model).to(self.device).requires_grad_(False)  # type: ignore[arg-type]
        self.critic = self._make_critic(model, critic) if critic is not None else None
        self.activation_checkpointing = activation_checkpointing
        if activation_checkpointing:
            # Each decoder block recomputed in backward (non-reentrant: works under FSDP2's
            # hooks and with inputs that need no grad). An engine that rebuilds the model in
            # `_wrap` (megatron) sets its own recomputation from the flag.
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.model = self._wrap(model)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, weight_decay=weight_decay
        )
        self.max_grad_norm = max_grad_norm
        self.loss_config = loss
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.base_lr, self.lr_schedule = lr, lr_schedule
        self.ppo_epochs, self.ppo_mini_batches = ppo_epochs, ppo_mini_batches
        self.step = 0
        self.optimizer_offload = Offload(self._optimizer_state)
        """The optimizer state off the device between colocated turns (`release_optimizer`)."""

    def _optimizer_state(self) -> list[torch.Tensor]:
        """The optimizers' state on the engine's device (the policy's; the critic's too)."""
        optimizers = [self.optimizer] + ([self.critic.optimizer] if self.critic else [])
        return optimizer_state(optimizers, self.device)

    def release_optimizer(self) -> int:
        """The optimizer state off the device (`engines.protocols.ReleasableTrainEngine`); the
        bytes moved."""
        return self.optimizer_offload.release()

    def resume_optimizer(self) -> int:
        """The optimizer state back on the device; the bytes moved."""
        return self.optimizer_offload.resume()

    def _optimizer_held(self, what: str) -> None:
        """RuntimeError when the optimizer state is released: `what` would read freed
        storages (a step faults or trains on garbage, a save writes empty tensors)."""
        if self.optimizer_offload.released:
            raise RuntimeError(f"the optimizer state is released: resume_optimizer before {what}")

    def _load_model(self, model_dir: Path, whole: bool) -> PreTrainedModel:
        """The HF model in float32 on the CPU (`whole`: the reference copy or the critic needs
        every weight here; an engine that shards may load less when it is False)."""
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        )
        return model

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The loaded model as this engine trains it: here, moved to the device."""
        return model.to(self.device)

    def _make_critic(self, model: torch.nn.Module, cfg: CriticConfig) -> Critic:
        """The value model, copied from the loaded policy before `_wrap` (the fsdp engine's
        shards it like the policy)."""
        return Critic(model, cfg, self.device, self._autocast, _positions)

    def _autocast(self) -> AbstractContextManager[Any]:
        return autocast(self.device, self.compute_dtype)

    def _token_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        entropy: bool = True,
        model: torch.nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T] ids -> [B, T] log p(x[t] | x[<t]) at the configured temperature, and [B, T] the
        entropy of each position's predicting distribution (if `entropy`); 0 at t = 0, which
        nothing predicts.

        Chunked (`logprob_chunk_tokens` > 0): from the final hidden states [B, T, H] and the
        output projection [V, H], never holding [B, T, V]; else from the model's logits. The
        entropy carries a gradient when the loss has an entropy bonus. `model`: default the policy.
        """
        model = self.model if model is None else model
        targets = input_ids[:, 1:]
        if not self.logprob_chunk_tokens:
            logits = self._token_logits(input_ids, attention_mask, model)
            # The entropy keeps its graph only when the loss has an entropy bonus.
            kept = logits if self.loss_config.entropy_coef else logits.detach()
            return _aligned(gather_logprobs(logits, targets)), _aligned(
                entropy_from_logits(kept)
            ) if entropy else None
        logprobs, entropies = self._chunked_logprobs(model, input_ids, attention_mask)
        return _aligned(logprobs), _aligned(entropies) if entropy else None

    def _chunked_logprobs(
        self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] ids -> ([B, T - 1] log-probs, [B, T - 1] entropies), chunked over positions
        (`chunked_model_logprobs`); the fsdp engine runs it inside its root module's forward."""
        return chunked_model_logprobs(
            model,
            input_ids,
            attention_mask,
            self.loss_config.temperature,
            self.logprob_chunk_tokens,
            self._autocast,
        )

    def _token_logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        model: torch.nn.Module | None = None,
    ) -> torch.Tensor:
        """[B, T] ids -> [B, T - 1, V] float32 logits of `model` (the policy by default) predicting
        tokens 1..T-1, divided by the temperature: the full-logits path
        (`logprob_chunk_tokens` 0)."""
        model = self.model if model is None else model
        with self._autocast():
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=_positions(attention_mask),
            )
        return scaled_logits(out.logits[:, :-1].float(), self.loss_config.temperature)

    @torch.no_grad()
    def token_limits(self) -> tuple[int, int | None]:
        """Rows of the input embedding, and the config's `max_position_embeddings` (or None)."""
        embedding = self.model.get_input_embeddings()  # type: ignore[operator]
        return embedding.num_embeddings, getattr(self.model.config, "max_position_embeddings", None)

    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] float32 log-probs under the current weights at the configured temperature."""
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        logprobs, _ = self._token_logprobs(input_ids, attention_mask, entropy=False)
        return logprobs.cpu()

    def train_step(self, micro_batches: Sequence[MicroBatch]) -> dict[str, float]:
        """`ppo_epochs` x `ppo_mini_batches` optimizer updates over `micro_batches`; one step.

        Each update accumulates over its mini-batch's micro-batches (the loss normalised by that
        mini-batch's count over every rank), clips the grad norm and takes one AdamW step at
        lr x lr_schedule(step). An update whose gradient is not finite leaves the weights as
        they were. With a decoupled loss and more than one update, the proximal log-probs are
        recomputed here before the first update, so later updates' ratios move away from 1.

        Returns, over the response tokens of every update: loss (mean over updates), clip_frac
        (clip_frac_low / clip_frac_high: ratio below / above 1; dual_clip_frac), ratio_mean,
        is_weight_mean, is_weight_std, is_masked_frac, is_rejected (sequences per pass), entropy,
        kl, logprob_gap (mean |log pi - log pi_behaviour|), log_ratio_clamped (tokens per pass, a
        count: one such token is the signal, and as a fraction of a large step it would read 0.000),
        grad_norm (before clipping, mean over updates), lr, updates, tokens (response tokens
        of the step), step (after). With a critic also value_loss (mean over updates),
        value_clip_frac, critic_grad_norm, and before the step's updates value_mean, return_mean,
        explained_variance.
        """
        self._optimizer_held("a train step")
        self.model.train()
        multi = self.ppo_epochs * self.ppo_mini_batches > 1
        proximal = self._proximal(micro_batches) if multi and self.loss_config.decoupled else None
        factor = self.lr_schedule(self.step) if self.lr_schedule is not None else 1.0
        lr = self.base_lr * factor
        targets: list[Targets] | None = None
        critic_stats: dict[str, float] = {}
        if self.critic is not None:  # the rows' outcome scores become GAE token advantages
            micro_batches, targets, critic_stats = self.critic.prepare(micro_batches, factor)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        totals = dict.fromkeys(METRIC_SUMS, 0.0)
        if self.critic is not None:
            totals |= dict.fromkeys((*CRITIC_SUMS, "critic_grad_norm"), 0.0)
        norms: list[float] = []
        chunks = [
            list(c) for c in np.array_split(np.arange(len(micro_batches)), self.ppo_mini_batches)
        ]
        for _ in range(self.ppo_epochs):
            for chunk in chunks:
                norm = self._update(
                    [micro_batches[i] for i in chunk],
                    None if proximal is None else [proximal[i] for i in chunk],
                    totals,
                    None if targets is None else [targets[i] for i in chunk],
                )
                if norm is not None:
                    norms.append(norm)
        totals = self._reduce(totals)
        self.step += 1
        tokens = max(totals["tokens"], 1.0)
        updates = max(len(norms), 1)
        mean_weight = totals["is_weight"] / tokens
        if self.critic is not None:
            critic_stats |= {
                "value_loss": totals["value_loss"] / updates,
                "value_clip_frac": totals["value_clipped"] / tokens,
                "critic_grad_norm": totals["critic_grad_norm"] / updates,
            }
        return {
            "loss": totals["loss"] / updates,
            "clip_frac": totals["clipped"] / tokens,
            "clip_frac_low": totals["clipped_low"] / tokens,
            "clip_frac_high": totals["clipped_high"] / tokens,
            "dual_clip_frac": totals["dual_clipped"] / tokens,
            "ratio_mean": totals["ratio"] / tokens,
            "is_weight_mean": mean_weight,
            "is_weight_std": max(totals["is_weight_sq"] / tokens - mean_weight**2, 0.0) ** 0.5,
            "is_masked_frac": totals["is_masked"] / tokens,
            "is_rejected": totals["is_rejected"] / self.ppo_epochs,
            "entropy": totals["entropy"] / tokens,
            "kl": totals["kl"] / tokens,
            "logprob_gap": totals["logprob_gap"] / tokens,
            "log_ratio_clamped": totals["log_ratio_clamped"] / self.ppo_epochs,
            "grad_norm": sum(norms) / updates,
            "lr": lr,
            "updates": float(len(norms)),
            "tokens": totals["tokens"] / self.ppo_epochs,
            "step": float(self.step),
            **critic_stats,
        }

    def _update(
        self,
        micro_batches: Sequence[MicroBatch],
        proximal: Sequence[torch.Tensor] | None,
        totals: dict[str, float],
        targets: Sequence[Targets] | None = None,
    ) -> float | None:
        """One optimizer update over `micro_batches` (with their proximal log-probs, if any),
        adding its metric sums to `totals`; its grad norm, or None if no rank had a pass. With a
        critic, its update over the same micro-batches (value `targets`) too."""
        mode = self.loss_config.aggregation
        denominator, passes = self._step_shape(micro_batches)
        if passes == 0:
            return None
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            self.critic.zero_grad()
        for index in range(passes):
            # A rank with fewer micro-batches than the busiest runs empty passes: every rank
            # must join the same collectives (parameter gathers, the last pass's gradient sync).
            real = index < len(micro_batches)
            batch = micro_batches[index] if real else empty_pass(micro_batches)
            self._before_backward(last=index == passes - 1)
            objective = self._objective(
                batch, proximal[index] if proximal is not None and real else None
            )
            mask = batch.loss_mask.to(self.device).float()
            loss = aggregate(
                objective.loss,
                mask,
                mode,
                denominator=denominator,
                norm_tokens=self.loss_config.norm_tokens,
            )
            loss.backward()
            totals["loss"] += loss.item()
            for name, value in objective.sums.items():
                totals[name] += value
            if self.critic is not None and targets is not None:
                # Every pass, empty ones too: a sharded critic's ranks gather and sync together.
                sums = self.critic.accumulate(
                    batch,
                    targets[index] if real else None,
                    mode,
                    denominator,
                    self.loss_config.norm_tokens,
                    last=index == passes - 1,
                )
                for name, value in sums.items():
                    totals[name] += value
        grad_norm = self._clip_grad_norm()
        # The schemas refuse NaN and inf inputs, but extreme finite ones still overflow (a huge
        # advantage: the log-ratio is clamped, an advantage is not); one NaN update would poison
        # every weight for good.
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        if self.critic is not None:
            totals["critic_grad_norm"] += self.critic.update()
        return float(grad_norm)

    def _objective(self, batch: MicroBatch, proximal: torch.Tensor | None) -> TokenObjective:
        """The per-token objective of one micro-batch (`engines.algorithms.objective`)."""
        input_ids, attention = batch.input_ids.to(self.device), batch.attention_mask.to(self.device)
        logprobs, entropy = self._token_logprobs(input_ids, attention)
        ref = None if batch.ref_logprobs is None else batch.ref_logprobs.to(self.device).float()
        if ref is None and self.reference is not None:
            with torch.no_grad():
                ref, _ = self._token_logprobs(
                    input_ids, attention, entropy=False, model=self.reference
                )
        return token_objective(
            self.loss_config,
            logprobs,
            batch.behaviour_logprobs.to(self.device),
            batch.advantages.to(self.device).float(),
            batch.loss_mask.to(self.device).float(),
            proximal=None if proximal is None else proximal.to(self.device),
            entropy=entropy,
            ref_logprobs=ref,
        )

    @torch.no_grad()
    def _proximal(self, micro_batches: Sequence[MicroBatch]) -> list[torch.Tensor]:
        """[B, T] log-probs of each micro-batch under the weights before the step's first update
        (every rank runs as many forward passes as the busiest: FSDP gathers in forward)."""
        _, passes = self._step_shape(micro_batches)
        out = []
        for index in range(passes):
            batch = (
                micro_batches[index] if index < len(micro_batches) else empty_pass(micro_batches)
            )
            logprobs, _ = self._token_logprobs(
                batch.input_ids.to(self.device), batch.attention_mask.to(self.device), entropy=False
            )
            out.append(logprobs)
        return out[: len(micro_batches)]

    def _step_shape(self, micro_batches: Sequence[MicroBatch]) -> tuple[int, int]:
        """The loss denominator of the whole step (tokens or sequences) and the passes to run."""
        mode = self.loss_config.aggregation
        return sum(aggregation_count(mb.loss_mask, mode) for mb in micro_batches), len(
            micro_batches
        )

    def _before_backward(self, last: bool) -> None:
        """Called before each pass; `last` is the step's final one (where gradients sync)."""

    def _reduce(self, totals: dict[str, float]) -> dict[str, float]:
        """The step's metric sums over every rank (one rank: as they are)."""
        return totals

    def _clip_grad_norm(self) -> torch.Tensor:
        """Clips the gradient to `max_grad_norm`; returns its norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)

    def export_own_weights(self) -> dict[str, torch.Tensor]:
        """What this rank sends of a weight version: `export_weights()` (`weight_shards` is 1)."""
        return self.export_weights()

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Parameter name -> CPU contiguous copy (tied weights once, under their first name).

        Copies, not views: an optimizer step must not change a version being published.
        """
        return {
            name: param.detach().to("cpu", copy=True).contiguous()
            for name, param in self.model.named_parameters()
        }

    def has_checkpoint(self, path: Path) -> bool:
        """Whether `save_checkpoint(path)` has completed once (what a restart resumes from)."""
        return path.exists()

    def save_checkpoint(
        self,
        path: Path,
        extra: dict[str, Any] | None = None,
        before_replace: Callable[[], None] | None = None,
    ) -> None:
        """Writes model, optimizer, step, RNG states, the critic (and its optimizer) if any, and
        `extra` to `path` atomically.

        `before_replace` is called once the new checkpoint is written and synced, before it
        replaces the last one (the moment a kill leaves both: the trainer names it a crash point).

        `extra` must hold plain data (numbers, strings, lists, dicts, tensors): checkpoints
        are read back with ``weights_only=True``, which refuses arbitrary pickles.
        """
        self._optimizer_held("a checkpoint save")
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "rng": _rng_state(),
            "extra": extra or {},
            "model_dir": str(self.model_dir),
        }
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        _atomic_save(state, path, before_replace)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restores everything `save_checkpoint` wrote; returns its `extra`."""
        self.optimizer_offload.resume()  # the state it replaces: its spill dropped
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.critic is not None:
            if "critic" not in state:
                raise ValueError(
                    f"{path} holds no critic: a run without GAE cannot resume as "
                    "algorithm.advantage gae"
                )
            self.critic.load_state_dict(state["critic"])
        self.step = state["step"]
        _set_rng_state(state["rng"])
        return state["extra"]
