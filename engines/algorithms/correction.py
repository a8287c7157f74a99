"""Off-policy correction: importance weights of the proximal policy against the behaviour policy.

The trainer's proximal policy pi_prox (its weights before the step's first update) differs from
the behaviour policy pi_b that sampled the tokens (older weights, other numerics). Each token's
loss is multiplied by a weight built from r = pi_prox / pi_b: truncated (min(r, cap)), masked
(0 outside [low, high]), per token or one per sequence, and whole sequences whose divergence is
past a bound are rejected (weight 0). All [B, T] per-token tensors, masked by ``mask``.
"""

from dataclasses import dataclass
from typing import Literal

import torch

from engines.algorithms.losses import LOG_RATIO_BOUND, clamped_log_ratio


@dataclass(frozen=True)
class ISWeights:
    """weight: [B, T] detached, what each token's loss is multiplied by (0 where masked or
    rejected); raw: [B, T] r before truncation and masking; masked: [B, T] bool, zeroed by the
    mask bounds; rejected: [B] bool, sequences zeroed by the divergence bound;
    log_ratio_clamped: [B, T] bool, tokens whose log-ratio was clamped before exp."""

    weight: torch.Tensor
    raw: torch.Tensor
    masked: torch.Tensor
    rejected: torch.Tensor
    log_ratio_clamped: torch.Tensor


def is_weights(
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: Literal["token", "sequence"] = "token",
    cap: float | None = None,
    mask_low: float | None = None,
    mask_high: float | None = None,
    reject_log_ratio: float | None = None,
) -> ISWeights:
    """Importance weights of `proximal` [B, T] against `behaviour` [B, T] log-probs.

    token: r_t = exp(log pi_prox - log pi_b) per token. sequence: one r = exp(sum_t mask_t
    (log pi_prox - log pi_b)) for all the sequence's tokens (each token's log-ratio clamped to
    +-LOG_RATIO_BOUND, the sum too). Then min(r, cap) if `cap`; 0 where r < mask_low or
    r > mask_high; 0 on every token of a sequence with max_t |log pi_prox - log pi_b| >
    reject_log_ratio.
    """
    proximal, behaviour = proximal.detach(), behaviour.detach()
    log_ratio, clamped = clamped_log_ratio(proximal, behaviour)
    log_ratio = log_ratio * mask
    if level == "sequence":
        per_seq = log_ratio.sum(-1, keepdim=True).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # [B, 1]
        raw = torch.exp(per_seq).expand_as(log_ratio)
    elif level == "token":
        raw = torch.exp(log_ratio)
    else:
        raise ValueError(f"unknown IS level {level!r}")
    weight = raw if cap is None else raw.clamp(max=cap)
    masked = torch.zeros_like(mask, dtype=torch.bool)
    if mask_low is not None:
        masked |= raw < mask_low
    if mask_high is not None:
        masked |= raw > mask_high
    masked &= mask > 0
    rejected = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    if reject_log_ratio is not None:
        rejected = ((proximal - behaviour).abs() * mask).amax(-1) > reject_log_ratio  # [B]
    weight = weight.masked_fill(masked | rejected.unsqueeze(-1), 0.0)
    return ISWeights(weight, raw, masked, rejected, clamped & (mask > 0))
