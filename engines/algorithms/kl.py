"""Per-token estimators of KL(pi || pi_ref) from tokens sampled by pi (Schulman's k1/k2/k3).

All take log-probs [B, T] of the sampled tokens under the policy and the reference and
return [B, T]; mask and aggregate them like a loss (`engines.algorithms.losses.aggregate`),
or subtract them from the reward. With log r = log pi_ref - log pi:
"""

from collections.abc import Callable

import torch


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = -log r. Unbiased, high variance, can be negative per token."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = (log r)^2 / 2. Biased, low variance, >= 0; its gradient is the true KL's."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = (r - 1) - log r. Unbiased and >= 0 (GRPO's choice); r = exp(ref - logp)."""
    log_r = ref_logprobs - logprobs
    return torch.exp(log_r) - 1.0 - log_r


ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}
"""The estimators by the name `algorithm.kl_estimator` gives."""


def kl_in_reward(
    rewards: torch.Tensor, kl_tokens: torch.Tensor, mask: torch.Tensor, coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KL penalty in the reward (verl's `apply_kl_penalty`):
    token-level rewards and their totals.

    rewards [B]: each sequence's score; kl_tokens [B, T]: a per-token estimator of KL(pi || pi_ref)
    (k1/k2/k3 above); mask [B, T]: 1 on response tokens. Returns token_rewards [B, T] = -coef *
    kl on every response token, plus the score on the sequence's last response token (a row
    with no response token gets nothing), and totals [B] = score - coef * sum_t mask * kl, the
    token rewards' sum: what the per-sequence advantage estimators take.
    """
    mask = mask.to(kl_tokens.dtype)
    token_rewards = -coef * kl_tokens * mask
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).amax(-1)  # [B], -1 for a row with no response token
    rows = torch.nonzero(last >= 0).squeeze(-1)
    token_rewards[rows, last[rows]] += rewards[rows].to(token_rewards.dtype)
    totals = rewards.to(kl_tokens.dtype) - coef * (kl_tokens * mask).sum(-1)
    return token_rewards, totals


def adaptive_kl_coef(
    coef: float, current_kl: float, target: float, horizon: int, n_steps: int
) -> float:
    """The next KL coefficient of the adaptive controller (Ziegler et al. 2019; verl's
    AdaptiveKLController): error = clip(current_kl / target - 1, -0.2, 0.2), coef x (1 + error x
    n_steps / horizon). `current_kl`: the step's mean KL; `n_steps`: samples in the step."""
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)


def mean_sequence_kl(kl_tokens: torch.Tensor, mask: torch.Tensor) -> float:
    """The batch's KL as the adaptive controller reads it (verl): each sequence's mean over its
    response tokens [B], averaged over the sequences that have one."""
    mask = mask.to(kl_tokens.dtype)
    count = mask.sum(-1)
    has = count > 0
    if not bool(has.any()):
        return 0.0
    per_sequence = (kl_tokens * mask).sum(-1)[has] / count[has]
    return float(per_sequence.mean())
