"""GAE with a learned value model: token advantages, returns, whitening and the clipped value loss.

Pure functions of tensors (as verl's `compute_gae_advantage_return` and `compute_value_loss`).
Shapes: B sequences, T positions aligned as in `engines.protocols`: position t refers to token
x[t], so `values[:, t]` is V(s_t), the critic's estimate of the return from the state that chose
x[t] (read from the hidden state at t - 1). `mask` [B, T] is the loss mask (1 on response tokens);
everything off it is skipped by the recursions and zero in the results.

What spans a whole step (the whitening, the critic's step statistics) takes `all_sum`, the sums
of a few floats over every rank that trains the step (the identity with one rank), so that a
sharded engine's ranks whiten and report over the union of their micro-batches.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

AllSum = Callable[[list[float]], list[float]]
"""Floats -> each one summed over every rank of the step (called by every rank alike)."""


def one_rank(sums: list[float]) -> list[float]:
    """`AllSum` of a step trained by one process: the sums as they are."""
    return sums


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


def token_rewards(
    scores: torch.Tensor, mask: torch.Tensor, inside: torch.Tensor | None = None
) -> torch.Tensor:
    """GAE's [B, T] per-token rewards: the outcome `scores` [B] on each row's last loss token
    (`outcome_rewards`) plus the rewards `inside` the response [B, T] (per-turn rewards, each on
    its turn's last token; 0 off the mask), or the outcome alone for None. The outcome is added
    once: a turn's reward never holds the episode's end (`schemas.turn_rewards`)."""
    rewards = outcome_rewards(scores, mask)
    if inside is None:
        return rewards
    return rewards + inside.to(rewards.dtype) * mask


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


def whiten_step(
    advantages: list[torch.Tensor], masks: list[torch.Tensor], all_sum: AllSum = one_rank
) -> list[torch.Tensor]:
    """Whitens token advantages over every loss token of a step (all micro-batches, of every
    rank, together): (A - mean) / sqrt(var + 1e-8), var unbiased (verl's `masked_whiten`); 0 off
    the mask. One token: centred only (no variance to divide by). Two passes (the mean, then the
    squares about it), as a two-pass variance over the concatenated tokens."""
    total, weighted = all_sum(
        [
            sum(float(m.sum()) for m in masks),
            sum(float((a * m).sum()) for a, m in zip(advantages, masks, strict=True)),
        ]
    )
    if total == 0:
        return [a * m for a, m in zip(advantages, masks, strict=True)]
    mean = weighted / total
    (squares,) = all_sum(
        [sum(float((((a - mean) * m) ** 2).sum()) for a, m in zip(advantages, masks, strict=True))]
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


def value_stats(
    values: list[torch.Tensor],
    returns: list[torch.Tensor],
    masks: list[torch.Tensor],
    all_sum: AllSum = one_rank,
) -> dict[str, float]:
    """Over every loss token of a step (of every rank): value_mean, return_mean and
    explained_variance, 1 - Var(R - V) / Var(R) (1: the critic predicts the returns; 0: no
    better than their mean; negative: worse; NaN with fewer than 2 tokens or constant returns).
    values, returns, masks: [B, T] per micro-batch; float64 sums, two passes as `whiten_step`."""
    on = [m.double() for m in masks]
    ret = [r.double() for r in returns]
    gap = [r.double() - v.double() for r, v in zip(returns, values, strict=True)]
    tokens, v_sum, r_sum, g_sum = all_sum(
        [
            sum(float(m.sum()) for m in on),
            sum(float((v.double() * m).sum()) for v, m in zip(values, on, strict=True)),
            sum(float((r * m).sum()) for r, m in zip(ret, on, strict=True)),
            sum(float((g * m).sum()) for g, m in zip(gap, on, strict=True)),
        ]
    )
    count = max(tokens, 1.0)
    r_mean, g_mean = r_sum / count, g_sum / count
    # The (n - 1) of both unbiased variances cancels in their ratio.
    r_squares, g_squares = all_sum(
        [
            sum(float((((r - r_mean) * m) ** 2).sum()) for r, m in zip(ret, on, strict=True)),
            sum(float((((g - g_mean) * m) ** 2).sum()) for g, m in zip(gap, on, strict=True)),
        ]
    )
    explained = float("nan") if tokens < 2 or r_squares == 0.0 else 1.0 - g_squares / r_squares
    return {
        "value_mean": v_sum / count,
        "return_mean": r_sum / count,
        "explained_variance": explained,
    }


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """`value_stats`' explained variance of flat values and returns, [N] each (all loss tokens)."""
    ones = torch.ones_like(returns)
    return value_stats([values], [returns], [ones])["explained_variance"]
