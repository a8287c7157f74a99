"""GAE with a learned value model: token advantages, returns, whitening and the clipped value loss.

Pure functions of tensors (as verl's `compute_gae_advantage_return` and `compute_value_loss`).
Shapes: B sequences, T positions aligned as in `engines.protocols`: position t refers to token
x[t], so `values[:, t]` is V(s_t), the critic's estimate of the return from the state that chose
x[t] (read from the hidden state at t - 1). `mask` [B, T] is the loss mask (1 on response tokens);
everything off it is skipped by the recursions and zero in the results.
"""

from dataclasses import dataclass

import torch

WHITEN_EPS = 1e-8
"""Inside the rsqrt of the whitening (verl's `masked_whiten`)."""


def outcome_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One score per sequence [B] -> [B, T] token rewards: the score on the last loss token of
    its row, 0 elsewhere (a row with no loss token gets none)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).amax(-1)  # [B], -1 for an empty row
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] = scores[rows]
    return rewards


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, T], of token `rewards` [B, T] under `values` [B, T].

    Backwards over t, skipping tokens off the mask (they neither bootstrap nor carry a TD error):
        delta_t = r_t + gamma V_{t'} - V_t,    A_t = delta_t + gamma lam A_{t'}
    with t' the next loss token after t (V_{t'} = A_{t'} = 0 past the last one). Returns
    R_t = A_t + V_t are the critic's targets. No gradient flows (values are detached).
    """
    values = values.detach()
    mask = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    out = torch.zeros_like(values)
    for t in reversed(range(values.shape[-1])):
        on = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        next_value = on * values[:, t] + (1 - on) * next_value
        last_gae = on * gae + (1 - on) * last_gae
        out[:, t] = last_gae
    advantages = out * mask
    return advantages, (advantages + values) * mask


def whiten_step(advantages: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Whitens token advantages over every loss token of a step (all micro-batches together):
    (A - mean) / sqrt(var + 1e-8), var unbiased (verl's `masked_whiten`); 0 off the mask.
    One token: centred only (no variance to divide by)."""
    total = sum(float(m.sum()) for m in masks)
    if total == 0:
        return [a * m for a, m in zip(advantages, masks, strict=True)]
    mean = sum(float((a * m).sum()) for a, m in zip(advantages, masks, strict=True)) / total
    squares = sum(
        float((((a - mean) * m) ** 2).sum()) for a, m in zip(advantages, masks, strict=True)
    )
    var = squares / (total - 1) if total > 1 else 0.0
    scale = (var + WHITEN_EPS) ** -0.5 if total > 1 else 1.0
    return [(a - mean) * scale * m for a, m in zip(advantages, masks, strict=True)]


@dataclass(frozen=True)
class ValueLoss:
    """loss: [B, T] per-token value loss (to aggregate); clipped: [B, T] bool, where the clipped
    branch was the larger (verl's vf_clipfrac counts these)."""

    loss: torch.Tensor
    clipped: torch.Tensor


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> ValueLoss:
    """Clipped value loss per token: 0.5 max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2).

    values [B, T] (with grad), old_values [B, T] (the critic before the step's first update),
    returns [B, T]. The clip keeps one update from moving a value far from where the returns
    were computed (PPO's trust region for the critic). `clip` None: 0.5 (V - R)^2.
    """
    old_values, returns = old_values.detach(), returns.detach()
    plain = (values - returns) ** 2
    if clip is None:
        return ValueLoss(0.5 * plain, torch.zeros_like(plain, dtype=torch.bool))
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns) ** 2
    return ValueLoss(0.5 * torch.maximum(plain, clipped), (clipped > plain).detach())


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over loss tokens given flat, [N] each (1: the critic predicts the
    returns; 0: no better than their mean; negative: worse). NaN with fewer than 2 tokens or
    constant returns."""
    ret, val = returns.double(), values.double()
    if ret.numel() < 2 or float(ret.var()) == 0.0:
        return float("nan")
    return float(1.0 - (ret - val).var() / ret.var())
