"""The trainer's per-token objective: policy loss x IS weight, entropy bonus, KL to a reference.

A pure function of tensors (`token_objective`), so that every train engine forms the same loss
and every term is tested without a model. Shapes: B sequences, T positions; per-token tensors
aligned as in `engines.protocols`.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from engines.algorithms import kl
from engines.algorithms.correction import is_weights
from engines.algorithms.losses import (
    AggregationMode,
    PolicyLoss,
    cispo_loss,
    gspo_loss,
    ppo_clip_loss,
)

KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = kl.ESTIMATORS

METRIC_SUMS = (
    "loss",
    "clipped",
    "clipped_low",
    "clipped_high",
    "dual_clipped",
    "ratio",
    "is_weight",
    "is_weight_sq",
    "is_masked",
    "is_rejected",
    "entropy",
    "kl",
    "logprob_gap",
    "log_ratio_clamped",
    "tokens",
)
"""What a step sums over its micro-batches (and, with data-parallel ranks, over the ranks)."""


@dataclass(frozen=True)
class LossConfig:
    """How the policy loss is formed (the run config's `algorithm`, docs/algorithms.md).

    policy_loss: "ppo" (token ratio, clip-higher, optional dual-clip `dual_clip_c`), "gspo"
        (sequence ratio) or "cispo" (clipped ratio as a detached weight on log pi).
    eps_low / eps_high: clip range (GSPO wants ~3e-4 / 4e-4).
    aggregation, norm_tokens: see `engines.algorithms.losses.aggregate`.
    tis_cap, is_level, is_mask_low, is_mask_high, reject_log_ratio: see
        `engines.algorithms.correction.is_weights`. All None -> the ratio is taken against the
        behaviour log-probs. Any set -> decoupled PPO: the ratio against the proximal policy
        (this engine's weights before the step's first update) and each token weighted by
        the IS weight of the proximal against the behaviour policy.
    entropy_coef: the loss gets -coef * H per token. kl_coef, kl_estimator: +coef * KL(pi ||
        pi_ref) per token, pi_ref the frozen initial weights.
    temperature: must equal the rollout's sampling temperature, since behaviour log-probs
        are log_softmax(logits / temperature).
    """

    policy_loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip_c: float | None = None
    aggregation: AggregationMode = "token-mean"
    norm_tokens: int | None = None
    tis_cap: float | None = None
    is_level: Literal["token", "sequence"] = "token"
    is_mask_low: float | None = None
    is_mask_high: float | None = None
    reject_log_ratio: float | None = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    temperature: float = 1.0

    @property
    def decoupled(self) -> bool:
        """Whether the ratio is taken against the proximal policy, with an IS weight."""
        bounds = (self.tis_cap, self.is_mask_low, self.is_mask_high, self.reject_log_ratio)
        return any(bound is not None for bound in bounds)


@dataclass(frozen=True)
class TokenObjective:
    """loss: [B, T] per-token loss to aggregate (minimised); terms: the policy loss's parts;
    weight: [B, T] the IS weight it was scaled by; sums: METRIC_SUMS over the loss tokens,
    floats (everything but "loss", which the engine adds once aggregated)."""

    loss: torch.Tensor
    terms: PolicyLoss
    weight: torch.Tensor
    sums: dict[str, float]


def token_objective(
    cfg: LossConfig,
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    proximal: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> TokenObjective:
    """The per-token loss [B, T] of `logprobs` [B, T] (with grad) for sequences with `advantages`
    [B] (or per token, [B, T]: GAE).

    behaviour [B, T]: the rollout's log-probs; proximal [B, T]: the policy before the step's
    first update (default: `logprobs` detached, right for one update per batch); entropy [B, T]
    (with grad for the bonus); ref_logprobs [B, T]: the reference policy's (needed if kl_coef).
    """
    # Off the mask (prompt, padding, a multi-turn episode's environment tokens) no token was
    # sampled: there the old and reference log-probs are the policy's own (ratio 1, KL 0), so
    # that every term stays finite whatever those inputs hold, and the mask's 0 leaves it no
    # gradient. A KL estimator's exp of an improbable tool-result token's log-ratio overflows,
    # and inf x 0 is NaN.
    on, own = mask > 0, logprobs.detach()
    behaviour = torch.where(on, behaviour.detach(), own)
    proximal = own if proximal is None else torch.where(on, proximal.detach(), own)
    if ref_logprobs is not None:
        ref_logprobs = torch.where(on, ref_logprobs.detach(), own)
    if cfg.decoupled:
        isw = is_weights(
            proximal,
            behaviour,
            mask,
            level=cfg.is_level,
            cap=cfg.tis_cap,
            mask_low=cfg.is_mask_low,
            mask_high=cfg.is_mask_high,
            reject_log_ratio=cfg.reject_log_ratio,
        )
        old, weight, masked, rejected, is_clamped = (
            proximal,
            isw.weight,
            isw.masked,
            isw.rejected,
            isw.log_ratio_clamped,
        )
    else:
        old, weight = behaviour, torch.ones_like(logprobs)
        masked = is_clamped = torch.zeros_like(mask, dtype=torch.bool)
        rejected = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    if cfg.policy_loss == "ppo":
        terms = ppo_clip_loss(
            logprobs,
            old,
            advantages,
            eps_low=cfg.eps_low,
            eps_high=cfg.eps_high,
            dual_clip_c=cfg.dual_clip_c,
        )
    elif cfg.policy_loss == "gspo":
        terms = gspo_loss(
            logprobs, old, advantages, mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high
        )
    else:
        terms = cispo_loss(logprobs, old, advantages, eps_low=cfg.eps_low, eps_high=cfg.eps_high)
    loss = terms.loss * weight
    kl_tokens = torch.zeros_like(logprobs)
    if cfg.entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef needs the per-token entropy")
        loss = loss - cfg.entropy_coef * entropy
    if cfg.kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef needs the reference policy's log-probs")
    if (
        ref_logprobs is not None
    ):  # measured whenever known (KL in the reward too), a loss term with kl_coef
        kl_tokens = KL_ESTIMATORS[cfg.kl_estimator](logprobs, ref_logprobs.detach())
        if cfg.kl_coef:
            loss = loss + cfg.kl_coef * kl_tokens
    clamped = terms.log_ratio_clamped | is_clamped
    dual = terms.dual_clipped if terms.dual_clipped is not None else torch.zeros_like(clamped)
    with torch.no_grad():

        def total(values: torch.Tensor) -> float:
            return float((values.float() * mask).sum().item())

        sums = {
            "clipped": total(terms.clipped),
            "clipped_low": total(terms.clipped & (terms.ratio < 1.0)),
            "clipped_high": total(terms.clipped & (terms.ratio > 1.0)),
            "dual_clipped": total(dual),
            "ratio": total(terms.ratio),
            "is_weight": total(weight),
            "is_weight_sq": total(weight * weight),
            "is_masked": total(masked),
            "is_rejected": float((rejected & on.any(-1)).sum().item()),
            "entropy": total(entropy) if entropy is not None else 0.0,
            "kl": total(kl_tokens),
            "logprob_gap": total((logprobs.detach() - behaviour).abs()),
            "log_ratio_clamped": total(clamped),
            "tokens": float(mask.sum().item()),
        }
    return TokenObjective(loss, terms, weight, sums)
