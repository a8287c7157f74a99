"""Reference train engine: one HF causal LM, AdamW, plain torch (CPU or one GPU).

One `train_step` = gradient accumulation over the step's micro-batches + one optimizer
step, so the policy version equals `step`. The loss is normalised by the token (or
sequence) count of the *whole step*, so splitting a batch into micro-batches does not
change the gradient.
"""

import os
import random
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from engines.algorithms.logprobs import chunked_logprobs
from engines.algorithms.losses import (
    AggregationMode,
    PolicyLoss,
    aggregate,
    aggregation_count,
    clamped_log_ratio,
    entropy_from_logits,
    gather_logprobs,
    gspo_loss,
    ppo_clip_loss,
    truncated_is_weight,
)
from engines.device import autocast
from engines.protocols import MicroBatch

METRIC_SUMS = ("loss", "clipped", "ratio", "is_weight", "entropy", "log_ratio_clamped", "tokens")
"""What a step sums over its micro-batches (and, with data-parallel ranks, over the ranks)."""


@dataclass(frozen=True)
class LossConfig:
    """How the policy loss is formed.

    policy_loss: "ppo" (token ratio, clip-higher) or "gspo" (sequence ratio).
    eps_low / eps_high: clip range (GSPO wants ~3e-4 / 4e-4).
    aggregation: see `engines.algorithms.losses.aggregate`.
    tis_cap: None -> the ratio is taken against the behaviour log-probs (PPO whose "old"
        policy is whatever generated the sample). A float -> decoupled PPO: the ratio is
        taken against the proximal policy (this engine's weights before the step, so it is
        1 in value and the clip never binds in a single-step update), and every token is
        weighted by min(pi_prox / pi_behaviour, tis_cap) to correct for staleness.
    temperature: must equal the rollout's sampling temperature, since behaviour log-probs
        are log_softmax(logits / temperature).
    """

    policy_loss: Literal["ppo", "gspo"] = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.28
    aggregation: AggregationMode = "token-mean"
    tis_cap: float | None = None
    temperature: float = 1.0


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] position ids counting real tokens only, so a row's padding (left or right) does
    not shift RoPE."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


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
    ) -> None:
        """`dtype` is the compute dtype of forward and backward (bfloat16: autocast); the
        master weights and the AdamW moments stay float32, which they need the precision of.
        `logprob_chunk_tokens`: positions projected onto the vocabulary at once when taking
        log-probs from the final hidden states (`engines.algorithms.logprobs`); 0: the full
        [B, T, V] logits."""
        _seed_everything(seed)
        self.device = torch.device(device)
        self.compute_dtype = dtype
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = self._wrap(model.to(self.device))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm
        self.loss_config = loss
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.step = 0

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def _autocast(self) -> AbstractContextManager[Any]:
        return autocast(self.device, self.compute_dtype)

    def _token_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, entropy: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T] ids -> [B, T] log p(x[t] | x[<t]) at the configured temperature, and [B, T] the
        entropy of each position's predicting distribution (if `entropy`); 0 at t = 0, which
        nothing predicts.

        Chunked (`logprob_chunk_tokens` > 0): from the final hidden states [B, T, H] and the
        output projection [V, H], never holding [B, T, V]; else from the model's logits.
        """
        targets = input_ids[:, 1:]
        if not self.logprob_chunk_tokens:
            logits = self._token_logits(input_ids, attention_mask)
            return (_aligned(gather_logprobs(logits, targets)),
                    _aligned(entropy_from_logits(logits.detach())) if entropy else None)
        with self._autocast():
            hidden = self.model.get_decoder()(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=_positions(attention_mask)
            ).last_hidden_state[:, :-1]  # [B, T - 1, H]: position t predicts token t + 1
        head = self.model.get_output_embeddings().weight  # [V, H]
        logprobs, entropies = chunked_logprobs(
            hidden, head, targets, self.loss_config.temperature, self.logprob_chunk_tokens
        )
        return _aligned(logprobs), _aligned(entropies) if entropy else None

    def _token_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] ids -> [B, T - 1, V] float32 logits predicting tokens 1..T-1, divided by the
        temperature: the full-logits path (`logprob_chunk_tokens` 0)."""
        with self._autocast():
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=_positions(attention_mask))
        logits = out.logits[:, :-1].float()
        return logits / self.loss_config.temperature if self.loss_config.temperature != 1.0 else logits

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] float32 log-probs under the current weights at the configured temperature."""
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        logprobs, _ = self._token_logprobs(input_ids, attention_mask, entropy=False)
        return logprobs.cpu()

    def _policy_loss(
        self, logprobs: torch.Tensor, batch: MicroBatch, mask: torch.Tensor
    ) -> tuple[PolicyLoss, torch.Tensor]:
        """Per-token policy loss [B, T] and the per-token IS weight [B, T] it was scaled by.

        Its `log_ratio_clamped` marks the tokens whose log-ratio against the behaviour policy
        was clamped: in the ratio, or with `tis_cap` in the IS weight (the ratio is then taken
        against the proximal policy, 1 in value, and never clamped).
        """
        cfg = self.loss_config
        behaviour = batch.behaviour_logprobs.to(self.device)
        advantages = batch.advantages.to(self.device).float()
        if cfg.tis_cap is None:
            old, weight = behaviour, torch.ones_like(logprobs)
            tis_clamped = torch.zeros_like(logprobs, dtype=torch.bool)
        else:
            old = logprobs.detach()
            weight = truncated_is_weight(old, behaviour, cfg.tis_cap)
            _, tis_clamped = clamped_log_ratio(old, behaviour)
        if cfg.policy_loss == "ppo":
            terms = ppo_clip_loss(
                logprobs, old, advantages, eps_low=cfg.eps_low, eps_high=cfg.eps_high
            )
        else:
            terms = gspo_loss(
                logprobs, old, advantages, mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high
            )
        clamped = terms.log_ratio_clamped | tis_clamped
        return PolicyLoss(terms.loss * weight, terms.ratio, terms.clipped, clamped), weight

    def train_step(self, micro_batches: Sequence[MicroBatch]) -> dict[str, float]:
        """Accumulates over `micro_batches`, clips the grad norm, takes one AdamW step.

        A step whose gradient is not finite leaves the weights as they were (still counted as
        a step, so versions stay aligned with the batches); its grad_norm says so.

        Returns loss, clip_frac, ratio_mean, is_weight_mean, entropy (all over response
        tokens), log_ratio_clamped (a count of response tokens whose log-ratio was clamped:
        one such token is the signal, and as a fraction of a large step it would read 0.000),
        grad_norm (before clipping), tokens (response tokens), step (after).
        """
        mode = self.loss_config.aggregation
        denominator, passes = self._step_shape(micro_batches)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals = dict.fromkeys(METRIC_SUMS, 0.0)
        for index in range(passes):
            # A rank with fewer micro-batches than the busiest runs empty passes: every rank
            # must join the same collectives (parameter gathers, the last pass's gradient sync).
            batch = micro_batches[index] if index < len(micro_batches) else _empty_like(micro_batches)
            self._before_backward(last=index == passes - 1)
            input_ids = batch.input_ids.to(self.device)
            mask = batch.loss_mask.to(self.device).float()
            logprobs, entropy = self._token_logprobs(input_ids, batch.attention_mask.to(self.device))
            assert entropy is not None
            terms, weight = self._policy_loss(logprobs, batch, mask)
            loss = aggregate(terms.loss, mask, mode, denominator=denominator)
            loss.backward()
            with torch.no_grad():
                totals["loss"] += loss.item()
                totals["clipped"] += (terms.clipped * mask).sum().item()
                totals["ratio"] += (terms.ratio * mask).sum().item()
                totals["is_weight"] += (weight * mask).sum().item()
                totals["entropy"] += (entropy * mask).sum().item()
                totals["log_ratio_clamped"] += (terms.log_ratio_clamped * mask).sum().item()
                totals["tokens"] += mask.sum().item()
        totals = self._reduce(totals)
        grad_norm = self._clip_grad_norm()
        # The schemas refuse NaN and inf inputs, but extreme finite ones still overflow (a huge
        # advantage: the log-ratio is clamped, an advantage is not); one NaN update would poison
        # every weight for good.
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        self.step += 1
        tokens = max(totals["tokens"], 1.0)
        return {
            "loss": totals["loss"],
            "clip_frac": totals["clipped"] / tokens,
            "ratio_mean": totals["ratio"] / tokens,
            "is_weight_mean": totals["is_weight"] / tokens,
            "entropy": totals["entropy"] / tokens,
            "log_ratio_clamped": totals["log_ratio_clamped"],
            "grad_norm": float(grad_norm),
            "tokens": totals["tokens"],
            "step": float(self.step),
        }

    def _step_shape(self, micro_batches: Sequence[MicroBatch]) -> tuple[int, int]:
        """The loss denominator of the whole step (tokens or sequences) and the passes to run."""
        mode = self.loss_config.aggregation
        return sum(aggregation_count(mb.loss_mask, mode) for mb in micro_batches), len(micro_batches)

    def _before_backward(self, last: bool) -> None:
        """Called before each pass; `last` is the step's final one (where gradients sync)."""

    def _reduce(self, totals: dict[str, float]) -> dict[str, float]:
        """The step's metric sums over every rank (one rank: as they are)."""
        return totals

    def _clip_grad_norm(self) -> torch.Tensor:
        """Clips the gradient to `max_grad_norm`; returns its norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)

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
        self, path: Path, extra: dict[str, Any] | None = None, before_replace: Callable[[], None] | None = None
    ) -> None:
        """Writes model, optimizer, step, RNG states and `extra` to `path` atomically.

        `before_replace` is called once the new checkpoint is written and synced, before it
        replaces the last one (the moment a kill leaves both: the trainer names it a crash point).

        `extra` must hold plain data (numbers, strings, lists, dicts, tensors): checkpoints
        are read back with ``weights_only=True``, which refuses arbitrary pickles.
        """
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "rng": _rng_state(),
            "extra": extra or {},
        }
        _atomic_save(state, path, before_replace)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restores everything `save_checkpoint` wrote; returns its `extra`."""
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        _set_rng_state(state["rng"])
        return state["extra"]


def _empty_like(micro_batches: Sequence[MicroBatch]) -> MicroBatch:
    """A pass that adds nothing: a 1-row batch with no loss token (its loss is exactly 0 and
    its gradient zeros, but it runs the model's forward and backward like any batch)."""
    if micro_batches:
        first = micro_batches[0]
        ids, attention = first.input_ids[:1], first.attention_mask[:1]
    else:
        ids, attention = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long)
    return MicroBatch(
        input_ids=ids, attention_mask=attention, loss_mask=torch.zeros(ids.shape), advantages=torch.zeros(1),
        behaviour_logprobs=torch.zeros(ids.shape),
    )


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    """Torch, numpy and Python RNG states as plain data (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": random.getstate(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    random.setstate(state["python"])


def _atomic_save(state: dict[str, Any], path: Path, before_replace: Callable[[], None] | None = None) -> None:
    """torch.save to a temporary sibling, fsync, then rename over `path`.

    A crash mid-write leaves the previous checkpoint intact: readers see the old file or
    the new one, never half of one. The temporary's name is fixed, so the half-written one
    a killed trainer leaves is overwritten by its successor's next save, not kept forever.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if before_replace is not None:
        before_replace()
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
