"""The algorithm family's knobs (issue 14), the base of `schemas.config.AlgorithmConfig`.

Each name selects a pure function of `engines.algorithms`; docs/algorithms.md gives the formulas.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.section import Section

AdvantageName = Literal[
    "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "passk", "gae"
]
GAE_KNOBS = ("gamma", "gae_lambda", "value_clip", "critic_lr")
"""Keys that apply to advantage gae only (off their defaults with another estimator:
refused at load)."""
PolicyLossName = Literal["ppo", "gspo", "cispo"]
AggregationName = Literal[
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]


class AlgorithmFamily(Section):
    advantage: AdvantageName = "grpo"
    """Advantage estimator (`engines.algorithms.advantages`): grpo (minus the group mean, over the
    group std), dr_grpo (minus the group mean), rloo (minus the others' mean), reinforce_pp (minus
    the step mean, over the step std), reinforce_pp_baseline (minus the group mean, over the step
    std), passk (pass@k group baseline for 0/1 rewards, `passk_k`), gae (per-token GAE against a
    value model the trainer holds and trains alongside the policy: `gamma`, `gae_lambda`,
    `value_clip`, `critic_lr`; torch and fsdp engines, not megatron)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """gae: discount per token (1: the outcome reward reaches every token undiscounted)."""
    gae_lambda: float = Field(0.95, ge=0, le=1)
    """gae: lambda of GAE (1: Monte Carlo returns minus the value; 0: one-step TD errors)."""
    value_clip: float | None = Field(0.2, gt=0)
    """gae: eps of the clipped value loss, 0.5 max((V - R)^2, (clip(V, V_old +- eps) - R)^2); None:
    plain 0.5 (V - R)^2."""
    critic_lr: float | None = Field(None, gt=0)
    """gae: the critic's own AdamW learning rate (its own optimizer, as verl's and OpenRLHF's
    critics have; the lr schedule applies to it too); None: `lr`."""
    passk_k: int = Field(1, ge=1)
    """k of the passk estimator (at most `data.n`); 1 is GRPO with the population std."""
    policy_loss: PolicyLossName = "ppo"
    """ppo: per-token ratio, clipped to [1 - clip_low, 1 + clip_high]
    (dual-clip with `dual_clip_c`). gspo: one length-normalised ratio per sequence (wants
    clip_low/clip_high near 3e-4/4e-4). cispo: the ratio clipped and detached as a weight on log pi
    (every token keeps its gradient)."""
    dual_clip_c: float | None = Field(None, gt=1)
    """Dual-clip PPO: for a negative advantage the per-token loss is at most -c * A (a ratio far
    above 1 cannot push the loss without bound). None: off. ppo only."""
    loss_aggregation: AggregationName = "token-mean"
    """How per-token losses become the step's loss: token-mean (over the step's loss tokens),
    token-sum (the plain sum), seq-mean-token-sum, seq-mean-token-mean (over the step's sequences
    with a loss token), seq-mean-token-sum-norm (each sequence's sum over `loss_scale_tokens`,
    averaged over sequences; Dr. GRPO's constant normaliser)."""
    loss_scale_tokens: int | None = Field(None, ge=1)
    """The constant of seq-mean-token-sum-norm; None: `data.sampling.max_tokens`."""
    is_level: Literal["token", "sequence"] = "token"
    """Importance weight pi_prox / pi_behaviour per token, or one per sequence (the product of its
    tokens' ratios, exp of the summed log-ratios); applies to `tis_cap` and the `is_mask_*`
    bounds."""
    is_mask_low: float | None = Field(None, gt=0, lt=1)
    """Masked IS: a token (or sequence) whose weight is below this trains with weight 0. None:
    off."""
    is_mask_high: float | None = Field(None, gt=1)
    """Masked IS: a token (or sequence) whose weight is above this trains with weight 0. None:
    off."""
    reject_log_ratio: float | None = Field(None, gt=0)
    """Reject (weight 0) a whole sequence if any of its tokens has |log pi_prox - log pi_behaviour|
    above this: the rollout and the trainer disagree too much for any correction. None: off."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus: the loss gets -coef * H per token (aggregated like the policy loss)."""
    kl_coef: float = Field(0.0, ge=0)
    """Coefficient of the KL to the frozen initial policy (with `kl_target`: its starting value);
    0: no KL, no reference model. Where the reference log-probs come from: the `reference` stage
    when `reference.enabled`, else a frozen copy of the initial weights the trainer holds."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The per-token KL estimator (`engines.algorithms.kl`)."""
    kl_placement: Literal["loss", "reward"] = "loss"
    """loss: +kl_coef * KL per token in the trainer's loss, against the current policy. reward:
    the buffer subtracts kl_coef * KL(pi_behaviour || pi_ref) per token from the reward before
    advantages (`engines.algorithms.kl.kl_in_reward`, verl's use_kl_in_reward); needs
    `reference.enabled` (the buffer takes the reference log-probs from the `scored` stream)."""
    kl_target: float | None = Field(None, gt=0)
    """Adaptive KL coefficient (Ziegler et al.; `engines.algorithms.kl.adaptive_kl_coef`): after
    each step the coefficient moves toward the value at which the step's mean KL is this. None:
    fixed at kl_coef. kl_placement reward only (as verl); the coefficient of every step rides in
    its batch events, so a restarted buffer goes on from the stream."""
    kl_horizon: int = Field(10_000, ge=1)
    """The adaptive controller's horizon, in samples: coef *= 1 + clip(kl / target - 1, +-0.2) x
    samples in the step / horizon."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Steps over which the learning rate rises linearly from lr / warmup to lr."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warmup: constant, or cosine decay to lr * lr_min_ratio at `trainer.steps`."""
    lr_min_ratio: float = Field(0.0, ge=0, le=1)
    """Where the cosine decay ends, as a fraction of lr."""
    overlong_filter: bool = False
    """DAPO overlong filtering: a response cut by the token limit (finish_reason length) gets
    advantage 0 (its tokens carry no gradient; they still count in token-mean's denominator)."""
    overlong_buffer_tokens: int = Field(0, ge=0)
    """DAPO soft overlong penalty: 0 off; else a response longer than max_tokens - this gets
    reward - overlong_penalty * (length - (max_tokens - this)) / this, before advantages."""
    overlong_penalty: float = Field(1.0, ge=0)
    """The largest soft overlong penalty (at max_tokens)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each step's batch, each pass `ppo_mini_batches` optimizer updates; the weight
    version still advances by one per step. With a decoupled loss (`tis_cap`, `is_mask_*`,
    `reject_log_ratio`) the ratio is taken against the proximal policy, recomputed by the trainer
    before the first update, and the IS weight against the behaviour policy."""
    ppo_mini_batches: int = Field(1, ge=1)
    """Optimizer updates per pass: the step's micro-batches (per rank) split into this many
    contiguous groups (one with no micro-batch on any rank is skipped)."""

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmFamily:
        if self.dual_clip_c is not None and self.policy_loss != "ppo":
            raise ValueError(
                f"algorithm.dual_clip_c applies to policy_loss ppo, not {self.policy_loss}"
            )
        if self.kl_target is not None and self.kl_placement != "reward":
            raise ValueError(
                "algorithm.kl_target (adaptive KL) applies to kl_placement reward, "
                "as verl's controller does"
            )
        if self.kl_placement == "reward" and not self.kl_coef:
            raise ValueError(
                "algorithm.kl_placement reward needs kl_coef > 0 "
                "(the starting coefficient with kl_target)"
            )
        if self.kl_placement == "reward" and self.advantage == "gae":
            raise ValueError(
                "algorithm.kl_placement reward does not apply to advantage gae yet: its critic "
                "takes the outcome reward on the last token, and a per-token KL penalty does not "
                "ride in the batch (use kl_placement loss)"
            )
        # Off their defaults rather than "set": a config read back from the run's KV has every key
        # set.
        defaults = {name: type(self).model_fields[name].default for name in GAE_KNOBS}
        if self.advantage != "gae" and (
            knobs := [k for k in GAE_KNOBS if getattr(self, k) != defaults[k]]
        ):
            raise ValueError(f"algorithm.{knobs[0]} applies to advantage gae, not {self.advantage}")
        if self.advantage == "gae" and self.overlong_filter:
            raise ValueError(
                "algorithm.overlong_filter does not apply to advantage gae: a zero reward still "
                "trains against the critic's values (use overlong_buffer_tokens to penalise long "
                "responses)"
            )
        if self.advantage == "passk" and self.overlong_buffer_tokens:
            raise ValueError(
                "algorithm.advantage passk takes 0/1 rewards: the overlong penalty would change "
                "them"
            )
        return self
