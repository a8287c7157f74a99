"""Per-token estimators of KL(pi || pi_ref) from tokens sampled by pi (Schulman's k1/k2/k3).

All take log-probs [B, T] of the sampled tokens under the policy and the reference and
return [B, T]; mask and aggregate them like a loss (`engines.algorithms.losses.aggregate`),
or subtract them from the reward. With log r = log pi_ref - log pi:
"""

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
