"""The value model of `algorithm.advantage: gae`, held and trained by the train engine.

A copy of the policy's decoder (initialised from the same weights) with a value head
Linear(hidden, 1), its own AdamW (`algorithm.critic_lr`), trained in the same updates as the
policy (PPO epochs and mini-batches apply to both):

    train_step(micro-batches carrying one outcome score per row)
      prepare   V_old = critic(x) per token          [B, T] each micro-batch, no grad
                r_t   = score on the row's last response token (+ each model turn's reward
                        on its last token with `agent.turn_rewards`: the batch's token_rewards)
                A, R  = GAE(r, V_old; gamma, lambda), R = A + V_old
                A     whitened over every response token of the step -> the policy's advantages
      for each update: policy backward, then `accumulate` (clipped value loss against R, V_old,
                aggregated like the policy loss) per micro-batch, then `update` (clip, AdamW step)

The numerics are `engines.algorithms.gae`; this module holds the model and its optimizer only.
`Critic` is the torch engine's (one process); its hooks (`_build`, `_passes`, `_all_sum`,
`_before_backward`, `_clip_grad_norm`) are where a data-parallel engine's critic differs
(`engines.fsdp_critic`: sharded, the step's passes, sums and gradient norm over every rank).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from engines.algorithms.gae import (
    gae_advantages,
    token_rewards,
    value_loss,
    value_stats,
    whiten_step,
)
from engines.algorithms.losses import AggregationMode, aggregate
from engines.protocols import MicroBatch, empty_pass

CRITIC_SUMS = ("value_loss", "value_clipped")
"""The critic's metric sums of a step, summed over ranks as the policy's `METRIC_SUMS` are."""

PositionIds = Callable[[torch.Tensor], torch.Tensor]
"""[B, T] attention mask -> [B, T] position ids (the policy's convention, so both read alike)."""


@dataclass(frozen=True)
class CriticConfig:
    """lr: the critic's AdamW learning rate (the policy's lr schedule multiplies it too);
    gamma, lam: GAE's discount and lambda; value_clip: eps of the clipped value loss (None: plain
    squared error); weight_decay, max_grad_norm: as the policy's."""

    lr: float
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float | None = 0.2
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0


@dataclass(frozen=True)
class Targets:
    """What one micro-batch's value loss is taken against: old_values [B, T] (the critic before
    the step's first update) and returns [B, T] (A + V_old, unwhitened); 0 off the loss mask."""

    old_values: torch.Tensor
    returns: torch.Tensor


class ValueModel(torch.nn.Module):
    """A decoder (copied from the policy) and Linear(hidden, 1): [B, T] ids -> [B, T] values."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self.backbone = copy.deepcopy(policy.get_decoder())  # type: ignore[operator]
        self.head = torch.nn.Linear(policy.config.hidden_size, 1)  # type: ignore[arg-type, union-attr]
        # Zero: V = 0 at first, so the first step's advantages are the whitened outcome rewards
        # (REINFORCE's), not the noise of a random head.
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """Position t holds V(s_t), the value of the state that chose token t (from the hidden
        state at t - 1, as log p(x[t] | x[<t]) is); 0 at t = 0. [B, T] float32."""
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state[:, :-1]  # [B, T - 1, H]
        # In the head's dtype: float32 here (autocast may still compute it in bf16), bf16 under
        # FSDP's mixed precision, whose gathered parameters are the compute dtype.
        values = self.head(hidden.to(self.head.weight.dtype)).float().squeeze(-1)  # [B, T - 1]
        return torch.nn.functional.pad(values, (1, 0))


class Critic:
    """The value model, its optimizer and the per-step GAE targets (see the module docstring)."""

    def __init__(
        self,
        policy: torch.nn.Module,
        cfg: CriticConfig,
        device: torch.device,
        autocast: Callable[[], AbstractContextManager[Any]],
        positions: PositionIds,
    ) -> None:
        self.cfg, self.device, self.autocast, self.positions = cfg, device, autocast, positions
        self.model = self._build(ValueModel(policy))
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )

    # --- what a data-parallel critic overrides ------------------------------------------------

    def _build(self, model: ValueModel) -> torch.nn.Module:
        """The value model as it trains: here, moved to the device."""
        return model.to(self.device)

    def _passes(self, micro_batches: Sequence[MicroBatch]) -> int:
        """Forward passes to run over the step's micro-batches (the busiest rank's count)."""
        return len(micro_batches)

    def _all_sum(self, sums: list[float]) -> list[float]:
        """Each float summed over every rank of the step (`engines.algorithms.gae.AllSum`)."""
        return sums

    def _before_backward(self, last: bool) -> None:
        """Called before each backward; `last` is the update's final one."""

    def _clip_grad_norm(self) -> torch.Tensor:
        """Clips the gradient to `max_grad_norm`; its norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)

    # --- the step ------------------------------------------------------------------------------

    def values(self, batch: MicroBatch) -> torch.Tensor:
        """[B, T] values of a micro-batch's rows (with grad if enabled)."""
        ids, attention = batch.input_ids.to(self.device), batch.attention_mask.to(self.device)
        with self.autocast():
            return self.model(ids, attention, self.positions(attention)).float()

    @torch.no_grad()
    def prepare(
        self, micro_batches: Sequence[MicroBatch], lr_factor: float
    ) -> tuple[list[MicroBatch], list[Targets], dict[str, float]]:
        """The step's micro-batches with their [B] outcome scores replaced by whitened [B, T]
        GAE advantages, each one's value targets, and the step's critic metrics before any
        update: value_mean (V_old), return_mean, explained_variance (of R by V_old); the
        whitening and the metrics span every rank's micro-batches."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * lr_factor
        self.model.train()
        raw, targets, masks = [], [], []
        for index in range(self._passes(micro_batches)):
            if index >= len(micro_batches):  # joins the busier ranks' gathers, adds nothing
                self.values(empty_pass(micro_batches))
                continue
            batch = micro_batches[index]
            mask = batch.loss_mask.to(self.device).float()
            old = self.values(batch) * mask
            scores = batch.advantages.to(self.device).float()
            inside = None if batch.token_rewards is None else batch.token_rewards.to(self.device)
            rewards = token_rewards(scores, mask, inside)
            advantages, returns = gae_advantages(rewards, old, mask, self.cfg.gamma, self.cfg.lam)
            raw.append(advantages)
            targets.append(Targets(old, returns))
            masks.append(mask)
        whitened = whiten_step(raw, masks, self._all_sum)
        out = [
            dataclasses.replace(b, advantages=a)
            for b, a in zip(micro_batches, whitened, strict=True)
        ]
        stats = value_stats(
            [t.old_values for t in targets], [t.returns for t in targets], masks, self._all_sum
        )
        return out, targets, stats

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def accumulate(
        self,
        batch: MicroBatch,
        targets: Targets | None,
        mode: AggregationMode,
        denominator: int,
        norm_tokens: int | None,
        last: bool = True,
    ) -> dict[str, float]:
        """Backward of one micro-batch's value loss, aggregated as the policy loss is (the same
        step denominator); its sums: value_loss (the aggregated loss), value_clipped (tokens).
        `targets` None: an empty pass (`engines.protocols.empty_pass`, no loss token); `last`:
        the update's final pass (where a sharded critic syncs its gradients)."""
        mask = batch.loss_mask.to(self.device).float()
        self._before_backward(last)
        values = self.values(batch)
        if targets is None:
            targets = Targets(torch.zeros_like(values), torch.zeros_like(values))
        terms = value_loss(values, targets.old_values, targets.returns, self.cfg.value_clip)
        loss = aggregate(terms.loss, mask, mode, denominator=denominator, norm_tokens=norm_tokens)
        loss.backward()
        return {
            "value_loss": float(loss.item()),
            "value_clipped": float((terms.clipped.float() * mask).sum().item()),
        }

    def update(self) -> float:
        """Clips the critic's gradient and steps its AdamW (skipped if the norm is not finite, as
        the policy's is); the norm before clipping."""
        norm = self._clip_grad_norm()
        if torch.isfinite(norm):
            self.optimizer.step()
        return float(norm)

    def state_dict(self) -> dict[str, Any]:
        """The value model and its optimizer, for the trainer's checkpoint."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
