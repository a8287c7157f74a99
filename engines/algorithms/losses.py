"""Policy-gradient losses, importance weights and loss aggregation, as pure tensor functions.

Shapes: B sequences, T positions, V vocabulary. Per-token tensors are aligned as in
`engines.protocols` (position t holds log p(x[t] | x[<t])). ``mask`` is the loss mask
(1 on response tokens). Losses are returned *per token* ([B, T], to be minimised) so that
any of them can be combined with any aggregation mode and with per-token weights.
"""

from dataclasses import dataclass
from typing import Literal

import torch

AggregationMode = Literal[
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]

LOG_RATIO_BOUND = 20.0
"""|log pi - log pi_old| is clamped to this before exp (as verl's PPO loss does): e^20 ~ 4.9e8 is
far past any clip range, yet times any sane advantage stays finite in float32, where exp(89)
is already inf. A behaviour log-prob far below the current one (a rollout numerics bug, a
token the rollout sampled from a corrupted distribution) would otherwise make the step's
gradient NaN, and the whole step would be skipped."""


@dataclass(frozen=True)
class PolicyLoss:
    """loss: [B, T] per-token loss; ratio: [B, T] importance ratio (detached);
    clipped: [B, T] bool, True where clipping zeroed the token's gradient (cispo: where the
    weight was clipped; the gradient stays);
    log_ratio_clamped: [B, T] bool, True where the token's log-ratio was out of
    [-LOG_RATIO_BOUND, LOG_RATIO_BOUND] and clamped;
    dual_clipped: [B, T] bool, True where dual-clip bound the loss at -c A (None: no dual clip)."""

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    log_ratio_clamped: torch.Tensor
    dual_clipped: torch.Tensor | None = None


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token]. logits [..., V], tokens [...] int64 -> [...] float32.

    logsumexp + gather instead of a full log_softmax: the [..., V] result is never
    materialised, which matters at a real vocabulary size.
    """
    logits = logits.float()
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits). [..., V] -> [...]; H = logsumexp(z) - sum p z."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def per_token(advantages: torch.Tensor) -> torch.Tensor:
    """[B] one advantage per sequence -> [B, 1] (broadcast over its tokens); [B, T] per-token
    advantages (GAE) as they are."""
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def clamped_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, bound: float = LOG_RATIO_BOUND
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi - log pi_old clamped to [-bound, bound], a bool mask of where it was clamped).

    Gradients follow `torch.clamp`: none through a clamped entry, so in PPO a token whose
    ratio is beyond any trust region does not steer the update (GSPO's gradient runs through
    log pi_t itself; there the clamp bounds only the ratio's value).
    """
    log_ratio = logprobs - old_logprobs
    return log_ratio.clamp(-bound, bound), (log_ratio.abs() > bound).detach()


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    log_ratio_clamped: torch.Tensor,
    dual_clip_c: float | None = None,
) -> PolicyLoss:
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), and with dual-clip, where A < 0, at most
    -c A (Ye et al. 2020). ratio [B, T], advantages [B] or [B, T]."""
    adv = per_token(advantages)  # [B, 1] (one per sequence) or [B, T]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    dual = None
    if dual_clip_c is not None:
        bound = -dual_clip_c * adv  # > 0 where A < 0
        dual = ((adv < 0) & (loss > bound)).detach()
        # A constant where it binds: a ratio far above 1 on a bad token stops steering the step.
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    return PolicyLoss(
        loss=loss,
        ratio=ratio.detach(),
        # The min picks the (constant) clipped branch exactly when it is strictly smaller.
        clipped=(clipped < unclipped).detach(),
        log_ratio_clamped=log_ratio_clamped,
        dual_clipped=dual,
    )


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip_c: float | None = None,
) -> PolicyLoss:
    """PPO clipped surrogate with asymmetric clip-higher (DAPO), optionally dual-clip.

    logprobs [B, T] (with grad), old_logprobs [B, T], advantages [B] (or [B, T] per token). A larger
    ``eps_high`` lets low-probability tokens with positive advantage grow further before
    clipping, which keeps entropy from collapsing. The log-ratio is clamped before exp
    (`clamped_log_ratio`). ``dual_clip_c`` (> 1): for A < 0 the loss is min(PPO loss, -c A).
    """
    log_ratio, clamped = clamped_log_ratio(logprobs, old_logprobs.detach())
    return _clipped_surrogate(
        torch.exp(log_ratio), advantages, eps_low, eps_high, clamped, dual_clip_c
    )


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> PolicyLoss:
    """CISPO (MiniMax-M1, 2025): -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi per token.

    logprobs [B, T] (with grad), old_logprobs [B, T], advantages [B] (or [B, T] per token). The
    clipped ratio is a detached weight, so unlike PPO no token loses its gradient: a clipped one
    keeps clip(r) A grad log pi. ``clipped`` marks where the weight was clipped.
    """
    log_ratio, clamped = clamped_log_ratio(logprobs.detach(), old_logprobs.detach())
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return PolicyLoss(
        loss=-(weight * per_token(advantages)) * logprobs,
        ratio=ratio,
        clipped=(weight != ratio),
        log_ratio_clamped=clamped,
    )


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> PolicyLoss:
    """GSPO (Zheng et al. 2025): one length-normalised ratio per sequence, clipped.

    s_i = exp(mean_t (log pi - log pi_old)) over the response tokens, [B]. Written in the
    paper's "GSPO-token" form, s_{i,t} = sg[s_i] * pi_t / sg[pi_t], whose value is s_i on
    every token and whose gradient is s_i * grad log pi_t; aggregated with
    ``seq-mean-token-mean`` it is exactly the sequence-level GSPO objective. Its clip range
    is tiny (a mean of log ratios moves little), hence the 3e-4 / 4e-4 defaults.

    Each token's log-ratio is clamped before the mean, so s_i is at most e^LOG_RATIO_BOUND and
    one far-off token moves its sequence's ratio by at most LOG_RATIO_BOUND / |y|.
    """
    log_ratio, clamped = clamped_log_ratio(logprobs, old_logprobs.detach())
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()
    return _clipped_surrogate(torch.exp(token_log_ratio), advantages, eps_low, eps_high, clamped)


def truncated_is_weight(
    proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """min(pi_prox / pi_behaviour, cap), detached. [B, T] -> [B, T].

    Corrects for samples drawn by an older (or numerically different) rollout policy
    without letting one rare token's huge ratio dominate the batch (truncated IS, as in
    verl's TIS and AReaL's decoupled PPO). The log-ratio is clamped before exp, as the
    policy losses' is: the cap alone already bounds the weight, the clamp keeps exp finite.
    """
    log_ratio, _ = clamped_log_ratio(proximal_logprobs, behaviour_logprobs)
    return torch.exp(log_ratio).clamp(max=cap).detach()


def aggregation_count(mask: torch.Tensor, mode: AggregationMode) -> int:
    """The denominator `aggregate` uses for `mask` [B, T]: loss tokens, sequences with any (an
    empty row is not counted), or 1 (token-sum)."""
    if mode == "token-mean":
        return int(mask.sum().item())
    if mode == "token-sum":
        return 1
    return int((mask.sum(-1) > 0).sum().item())


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: AggregationMode,
    denominator: float | None = None,
    norm_tokens: int | None = None,
) -> torch.Tensor:
    """Reduces a per-token loss [B, T] over the masked tokens to a scalar.

    - token-mean: sum over all tokens / number of tokens (long answers weigh more).
    - token-sum: sum over all tokens (scales with the batch; for a constant-size step).
    - seq-mean-token-sum: per-sequence sum, averaged over sequences (no length bias).
    - seq-mean-token-mean: per-sequence mean, averaged over sequences (original GRPO, GSPO).
    - seq-mean-token-sum-norm: per-sequence sum / ``norm_tokens`` (a constant such as the
      generation limit; default T), averaged over sequences (Dr. GRPO's normaliser).

    Sequences without a loss token count in no sequence mean. ``denominator`` overrides the
    count of tokens/sequences: pass the count over *all* micro-batches of a step
    (`aggregation_count`) so that accumulating micro-batch losses gives the same gradient as
    one big batch.
    """
    masked = loss * mask
    if mode in ("token-mean", "token-sum"):
        numerator = masked.sum()
    elif mode == "seq-mean-token-sum":
        numerator = masked.sum(-1).sum()
    elif mode == "seq-mean-token-mean":
        numerator = (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    elif mode == "seq-mean-token-sum-norm":
        numerator = masked.sum() / (norm_tokens or mask.shape[-1])
    else:
        raise ValueError(f"unknown aggregation mode {mode!r}")
    count = aggregation_count(mask, mode) if denominator is None else denominator
    return numerator / max(count, 1)
