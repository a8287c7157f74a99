"""Critic-free advantage estimators over groups of sampled responses.

Every function takes ``rewards`` of shape [..., G]: the last axis is one group (the G
samples drawn for one prompt), any leading axes (e.g. N prompts) are independent groups.
It returns one advantage per sequence, same shape; the trainer broadcasts it over the
sequence's response tokens (rewards are outcome rewards, no discounting).
"""

import math

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


def reinforce_pp(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): the reward whitened over the whole step, no per-group baseline.

    [N, G] -> [N, G]: (r - mean over all N*G) / (unbiased std over all N*G + eps). The batch
    mean is the only baseline, so a group whose rewards are all equal still gets a signal
    (how its prompt fared against the rest of the step).
    """
    flat = rewards.flatten()
    if flat.numel() < 2:
        raise ValueError("whitening over the step needs at least 2 samples")
    return (rewards - flat.mean()) / (flat.std() + EPS)


def passk(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """Pass@k group baseline (Chen et al. 2025, analytic form) for 0/1 rewards.
    [..., G] -> [..., G].

    The reward of a k-subset of the group is its best member's; a sample's advantage is the
    mean reward of the k-subsets holding it minus the mean over all k-subsets, over that
    subsets' reward std. With c correct of G and w = G - c wrong:
        R = 1 - C(w, k) / C(G, k),  s = sqrt(R (1 - R))
        A_correct = (1 - R) / s,    A_wrong = (1 - R - C(w - 1, k - 1) / C(G - 1, k - 1)) / s
    A group where every k-subset has the same reward (s = 0) gets zeros. k = 1 is GRPO with
    the population std.
    """
    group = rewards.shape[-1]
    if not 1 <= k <= group:
        raise ValueError(f"pass@k needs 1 <= k <= group size {group}, not {k}")
    if not bool(((rewards == 0) | (rewards == 1)).all()):
        raise ValueError("pass@k advantages need rewards of 0 or 1")
    wrong = (rewards == 0).sum(-1, keepdim=True).double()  # [..., 1]
    mean = 1.0 - _choose(wrong, k) / math.comb(group, k)
    std = (mean * (1.0 - mean)).sqrt()
    all_wrong_given_wrong = _choose(wrong - 1.0, k - 1) / math.comb(group - 1, k - 1)
    adv = torch.where(rewards == 1, 1.0 - mean, 1.0 - mean - all_wrong_given_wrong)
    return torch.where(std > EPS, adv / std.clamp(min=EPS), 0.0).to(rewards.dtype)


def _choose(n: torch.Tensor, k: int) -> torch.Tensor:
    """C(n, k) elementwise for float n >= -1 (0 where n < k),
    exact for the small ints of a group."""
    out = torch.ones_like(n)
    for i in range(k):
        out = out * (n - i).clamp(min=0) / (i + 1)
    return out


GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "passk")
"""Estimators that see one group at a time; the others whiten over the whole step."""
CRITIC_ESTIMATORS = ("gae",)
"""Estimators the trainer forms per token against its value model (`engines.algorithms.gae`): the
buffer hands it each sample's outcome reward in place of an advantage."""
ESTIMATORS = (*GROUP_ESTIMATORS, "reinforce_pp", "reinforce_pp_baseline", *CRITIC_ESTIMATORS)
"""Every name `step_advantages` takes (`algorithm.advantage`)."""


def step_advantages(
    name: str, groups: list[torch.Tensor], *, passk_k: int = 1
) -> list[torch.Tensor]:
    """The advantages of one step's groups ([G_i] rewards each, sizes may differ) by `name`.

    grpo, dr_grpo, rloo and passk see each group alone; reinforce_pp and reinforce_pp_baseline
    whiten over every sample of the step (after the group mean, for the baseline variant). gae
    returns the rewards as they are: the trainer turns them into token advantages with its critic.
    """
    if name in CRITIC_ESTIMATORS:
        return [g.clone() for g in groups]
    if name in GROUP_ESTIMATORS:
        one = {
            "grpo": grpo,
            "dr_grpo": dr_grpo,
            "rloo": rloo,
            "passk": lambda r: passk(r, passk_k),
        }[name]
        return [one(g) for g in groups]
    if name == "reinforce_pp":
        flat = reinforce_pp(torch.cat(groups))
    elif name == "reinforce_pp_baseline":
        flat = torch.cat([_centre(g) for g in groups])
        flat = flat / (flat.std() + EPS)
    else:
        raise ValueError(f"unknown advantage estimator {name!r}")
    return list(flat.split([g.numel() for g in groups]))
