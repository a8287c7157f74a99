"""The value model of `algorithm.advantage: gae`, held and trained by the torch train engine.

A copy of the policy's decoder (initialised from the same weights) with a value head
Linear(hidden, 1), its own AdamW (`algorithm.critic_lr`), trained in the same updates as the
policy (PPO epochs and mini-batches apply to both):

    train_step(micro-batches carrying one outcome score per row)
      prepare   V_old = critic(x) per token          [B, T] each micro-batch, no grad
                r_t   = score on the row's last response token
                A, R  = GAE(r, V_old; gamma, lambda), R = A + V_old
                A     whitened over every response token of the step -> the policy's advantages
      for each update: policy backward, then `accumulate` (clipped value loss against R, V_old,
                aggregated like the policy loss) per micro-batch, then `update` (clip, AdamW step)

The numerics are `engines.algorithms.gae`; this module holds the model and its optimizer only.
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
    explained_variance,
    gae_advantages,
    outcome_rewards,
    value_loss,
    whiten_step,
)
from engines.algorithms.losses import AggregationMode, aggregate
from engines.protocols import MicroBatch

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
        values = self.head(hidden.float()).squeeze(-1)  # [B, T - 1]
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
        self.model = ValueModel(policy).to(device)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )

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
        update: value_mean (V_old), return_mean, explained_variance (of R by V_old)."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * lr_factor
        self.model.train()
        raw, targets, masks = [], [], []
        for batch in micro_batches:
            mask = batch.loss_mask.to(self.device).float()
            old = self.values(batch) * mask
            rewards = outcome_rewards(batch.advantages.to(self.device).float(), mask)
            advantages, returns = gae_advantages(rewards, old, mask, self.cfg.gamma, self.cfg.lam)
            raw.append(advantages)
            targets.append(Targets(old, returns))
            masks.append(mask)
        whitened = whiten_step(raw, masks)
        out = [
            dataclasses.replace(b, advantages=a)
            for b, a in zip(micro_batches, whitened, strict=True)
        ]
        on = [m > 0 for m in masks]
        flat_v = (
            torch.cat([t.old_values[o] for t, o in zip(targets, on, strict=True)])
            if on
            else torch.zeros(0)
        )
        flat_r = (
            torch.cat([t.returns[o] for t, o in zip(targets, on, strict=True)])
            if on
            else torch.zeros(0)
        )
        tokens = max(flat_v.numel(), 1)
        stats = {
            "value_mean": float(flat_v.sum()) / tokens,
            "return_mean": float(flat_r.sum()) / tokens,
            "explained_variance": explained_variance(flat_v, flat_r),
        }
        return out, targets, stats

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def accumulate(
        self,
        batch: MicroBatch,
        targets: Targets,
        mode: AggregationMode,
        denominator: int,
        norm_tokens: int | None,
    ) -> dict[str, float]:
        """Backward of one micro-batch's value loss, aggregated as the policy loss is (the same
        step denominator); its sums: value_loss (the aggregated loss), value_clipped (tokens)."""
        mask = batch.loss_mask.to(self.device).float()
        terms = value_loss(
            self.values(batch), targets.old_values, targets.returns, self.cfg.value_clip
        )
        loss = aggregate(terms.loss, mask, mode, denominator=denominator, norm_tokens=norm_tokens)
        loss.backward()
        return {
            "value_loss": float(loss.item()),
            "value_clipped": float((terms.clipped.float() * mask).sum().item()),
        }

    def update(self) -> float:
        """Clips the critic's gradient and steps its AdamW (skipped if the norm is not finite, as
        the policy's is); the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        if torch.isfinite(norm):
            self.optimizer.step()
        return float(norm)

    def state_dict(self) -> dict[str, Any]:
        """The value model and its optimizer, for the trainer's checkpoint."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
