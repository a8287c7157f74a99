"""Critic-free advantage estimators over groups of sampled responses.

Every function takes ``rewards`` of shape [..., G]: the last axis is one group (the G
samples drawn for one prompt), any leading axes (e.g. N prompts) are independent groups.
It returns one advantage per sequence, same shape; the trainer broadcasts it over the
sequence's response tokens (rewards are outcome rewards, no discounting).
"""

import torch

EPS = 1e-6


def _centre(rewards: torch.Tensor) -> torch.Tensor:
    """r - mean over the group. [..., G] -> [..., G]."""
    if rewards.shape[-1] < 2:
        raise ValueError("a group needs at least 2 samples to have a baseline")
    return rewards - rewards.mean(dim=-1, keepdim=True)


def grpo(rewards: torch.Tensor, *, normalize_std: bool = True) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps). [..., G] -> [..., G].

    The std is the unbiased one (Bessel), as in verl. A group whose rewards are all equal
    gets zero advantages (no signal), not a division by zero. ``normalize_std=False`` keeps
    the raw centred reward, which does not up-weight near-solved or hopeless prompts.
    """
    centred = _centre(rewards)
    if not normalize_std:
        return centred
    return centred / (rewards.std(dim=-1, keepdim=True) + EPS)


def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): r - group mean, no std division. [..., G] -> [..., G].

    The other half of Dr. GRPO is in the loss: aggregate with ``seq-mean-token-sum`` so
    that long responses are not down-weighted per token.
    """
    return _centre(rewards)


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i - mean_{j != i} r_j. [..., G] -> [..., G].

    The leave-one-out baseline does not contain r_i, so it is unbiased; it equals
    G / (G - 1) * (r_i - mean).
    """
    group = rewards.shape[-1]
    return _centre(rewards) * group / (group - 1)


def reinforce_pp_baseline(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline: r - group mean, then divided by the std over the whole batch.

    [N, G] -> [N, G]. Normalising by the global std (not per group) keeps the scale
    stable without the per-prompt reweighting that per-group std introduces.
    """
    centred = _centre(rewards)
    return centred / (centred.std() + EPS)
