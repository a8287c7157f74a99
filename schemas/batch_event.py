"""The batch event: one gradient-ready micro-batch for one trainer rank at one step, as the
buffer packs it (`consumers.packing`) and the trainer reads it by position.

    id  <run>/step/<step>/<dp rank>/<micro index>

Kept apart from the other four events (`schemas.events`) as the weight event is
(`schemas.weight_event`): its rows are the trainer's, not a sample's.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from schemas.array_checks import at_least, checked_values, finite, log_probs
from schemas.events import Event
from schemas.tensor import Tensor
from schemas.turn_rewards import check_token_rewards


class BatchEvent(Event):
    """One gradient-ready micro-batch for one data-parallel rank at one step.

    Rows are right-padded to the longest sequence of the micro-batch; position t of the
    per-token arrays refers to token t of `input_ids` (its log-prob given tokens < t).

    Version 2 added `token_rewards`: a version-1 reader would train without them, so it refuses
    the event by its version; a version-1 event reads as one with none (`schemas.codec`).
    Version 3 added `solved_rate`; a version-2 event reads as one with none.
    """

    TYPE: ClassVar[str] = "jetrl.batch"
    VERSION: ClassVar[int] = 3
    type: Literal["jetrl.batch"] = "jetrl.batch"
    schema_version: Literal[3] = 3

    step: int = Field(ge=0)
    """Optimizer step this micro-batch belongs to (the weight version it will produce is step +
    1)."""
    dp_rank: int = Field(ge=0)
    """Data-parallel rank that trains it."""
    dp_size: int = Field(ge=1)
    """Data-parallel world size the batch was packed for."""
    micro_index: int = Field(ge=0)
    """Index of this micro-batch in the rank's step."""
    micro_count: int = Field(ge=1)
    """Micro-batches for this rank at this step."""
    input_ids: Tensor
    """Prompt + response token ids, int32 [B, T]."""
    attention_mask: Tensor
    """1 on real tokens, uint8 [B, T]."""
    loss_mask: Tensor
    """1 on response tokens that carry loss, uint8 [B, T]."""
    advantages: Tensor
    """Per-sequence advantage, float32 [B]."""
    behaviour_logprobs: Tensor
    """Log-prob of token t under the generating policy, float32 [B, T] (0 off the loss mask)."""
    versions: Tensor
    """Weight version that generated token t, int32 [B, T] (-1 off the loss mask)."""
    rewards: Tensor
    """Per-sequence reward, float32 [B], for logging."""
    sample_ids: tuple[str, ...]
    """Trajectory ids of the B rows."""
    step_prompt_ids: tuple[str, ...] = ()
    """Every group (prompt id) of the whole step, in packing order, so a restarted buffer
    can re-form a step it had only partly stored."""
    traceparents: tuple[str, ...] = ()
    """W3C traceparent of each row's prompt trace, so the train step can link them."""
    ref_logprobs: Tensor | None = None
    """Log-prob of token t under the frozen reference model, float32 [B, T] (0 off the loss mask),
    from the reference stage; None: the trainer scores the reference itself if it needs one."""
    kl_coef: float | None = Field(None, ge=0, allow_inf_nan=False)
    """With the KL in the reward: the coefficient the step's rewards were penalised with (the
    adaptive controller's state, so a restarted buffer goes on from the stream)."""
    kl_mean: float | None = Field(None, allow_inf_nan=False)
    """With the KL in the reward: the step's KL (mean over its sequences of the per-token mean),
    what the adaptive controller moves the next step's coefficient by."""
    tool_use_rate: float | None = Field(None, ge=0, le=1)
    """Agent episodes (`agent` in the run config): the fraction of the whole step's samples whose
    episode made at least one tool call (the same on every micro-batch of the step, for its
    metrics); None for single-turn samples."""
    turns_mean: float | None = Field(None, ge=0)
    """Agent episodes: the mean model turns of the whole step's samples' episodes; None for
    single-turn samples."""
    solved_rate: float | None = Field(None, ge=0, le=1)
    """Agent episodes: the fraction of the whole step's samples whose reward is 1.0, the task
    solved (`consumers.buffer_groups.episode_stats`); None for single-turn samples."""
    token_rewards: Tensor | None = None
    """With `agent.turn_rewards`: float32 [B, T], each model turn's reward on its last token
    (`schemas.turn_rewards.place`), 0 elsewhere and always 0 off the loss mask; GAE adds them to
    the outcome (`rewards`, on the last loss token). None: the outcome alone."""

    @model_validator(mode="after")
    def _shapes(self) -> BatchEvent:
        bt = self.input_ids.shape
        if len(bt) != 2:
            raise ValueError(f"input_ids must be [B, T], got {bt}")
        for name in ("attention_mask", "loss_mask", "behaviour_logprobs", "versions"):
            if getattr(self, name).shape != bt:
                raise ValueError(f"{name} has shape {getattr(self, name).shape}, expected {bt}")
        for name in ("advantages", "rewards"):
            if getattr(self, name).shape != bt[:1]:
                raise ValueError(f"{name} has shape {getattr(self, name).shape}, expected {bt[:1]}")
        if len(self.sample_ids) != bt[0]:
            raise ValueError(f"{len(self.sample_ids)} sample_ids for {bt[0]} rows")
        if self.micro_index >= self.micro_count or self.dp_rank >= self.dp_size:
            raise ValueError("micro_index/dp_rank out of range")
        if 0 in bt:
            raise ValueError(f"a micro-batch needs at least one row of one token, got {bt}")
        at_least("input_ids", checked_values("input_ids", self.input_ids, "int32", 2), 0)
        attention = checked_values("attention_mask", self.attention_mask, "uint8", 2)
        loss = checked_values("loss_mask", self.loss_mask, "uint8", 2)
        # loss <= attention <= 1 holds both masks 0/1: a loss value above 1 is above attention.
        if np.maximum.reduce(attention, axis=None) > 1 or np.greater(loss, attention).any():
            raise ValueError("masks must be 0/1, with loss_mask only where attention_mask is 1")
        on_loss = loss.view(np.bool_)  # 0/1 bytes: the loss mask itself, no copy
        finite("advantages", checked_values("advantages", self.advantages, "float32", 1))
        finite("rewards", checked_values("rewards", self.rewards, "float32", 1))
        log_probs(
            "behaviour_logprobs",
            checked_values("behaviour_logprobs", self.behaviour_logprobs, "float32", 2),
        )
        if self.ref_logprobs is not None:
            if self.ref_logprobs.shape != bt:
                raise ValueError(f"ref_logprobs has shape {self.ref_logprobs.shape}, expected {bt}")
            ref = checked_values("ref_logprobs", self.ref_logprobs, "float32", 2)
            log_probs("ref_logprobs", ref)
        if self.token_rewards is not None:
            check_token_rewards(self.token_rewards, ~on_loss)
        versions = checked_values("versions", self.versions, "int32", 2)
        at_least("versions", versions, -1)
        # A token trained at `step` was generated by weights no newer than the step's input.
        trained = versions[on_loss]
        if trained.size and (trained.min() < 0 or trained.max() > self.step):
            raise ValueError(f"versions on the loss mask must be in [0, step {self.step}]")
        return self
