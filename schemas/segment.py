"""An episode's earlier samples, carried inside its trajectory (issue 27), and the mask checks.

An agent episode whose chat template stops extending its tokens (one that strips earlier
`<think>`, a compacted context) continues as a new sample: its tokens so far can no longer be
the prefix of the next turn's prompt. Every sample is trained, and the group stays `data.n`
trajectories (one per episode), so the buffer's group accounting, dedup ids, crash points and
dead-lettering are those of a single-sample episode:

    TrajectoryEvent (one per episode)
        earlier: (Segment 0, Segment 1, ...)   the samples the episode left, in order
        prompt_ids / response_ids / ...        its last sample, as any trajectory
    -> `TrajectoryEvent.segments()`: every sample, earlier first, the last one last
    -> the buffer packs one row per segment (`consumers.packing.Row.all_of`), each with the
       episode's advantage and reward; the staleness bound and the group's oldest version count
       every segment's trained tokens (`TrajectoryEvent.trained_versions`)

Why inside one event and not one trajectory per sample: a group of a variable number of
trajectories would change what "complete" means to the buffer, and the ids `<prompt>/<index>`
that make every publish idempotent. An earlier segment always holds a model turn (a sample is
only left behind once it has one), so its mask is required and has a 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, model_validator

from schemas.array_checks import checked_values, log_probs, non_negative, vectors
from schemas.tensor import Tensor


class Segment(BaseModel):
    """One sample of an episode: its prompt and its response of model and environment tokens.

    prompt_ids int32 [P]; response_ids int32 [R]; logprobs float32 [R] (0.0 where the mask is
    0); versions int32 [R] (-1 where the mask is 0); response_mask uint8 [R] (1: a model token)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_ids: Tensor
    response_ids: Tensor
    logprobs: Tensor
    versions: Tensor
    response_mask: Tensor

    def trained_mask(self) -> np.ndarray:
        """bool [R]: True on the model's tokens."""
        return self.response_mask.numpy() == 1

    @model_validator(mode="after")
    def _aligned(self) -> Segment:
        r = self.response_ids.shape
        if len(r) != 1 or self.logprobs.shape != r or self.versions.shape != r:
            raise ValueError(
                f"segment response_ids {r}, logprobs {self.logprobs.shape} and versions "
                f"{self.versions.shape} must be equal 1-D"
            )
        ids = {"prompt_ids": self.prompt_ids, "response_ids": self.response_ids}
        vectors("int32", {**ids, "versions": self.versions})
        vectors("float32", {"logprobs": self.logprobs})
        if self.prompt_ids.shape == (0,) or r == (0,):
            raise ValueError(
                f"an earlier segment needs a prompt and a response, got {self.prompt_ids.shape} "
                f"and {r} tokens"
            )
        non_negative(ids)
        logprobs = self.logprobs.numpy()
        log_probs("logprobs", logprobs)
        masked_tokens(self.response_mask, self.versions.numpy(), logprobs)
        return self


def masked_tokens(mask: Tensor, versions: np.ndarray, logprobs: np.ndarray) -> None:
    """Raise unless `mask` is uint8 0/1 aligned with the response, with at least one model token
    (1) if the response has any, versions >= 0 at model tokens and exactly -1 at the others,
    and log-probs exactly 0.0 at the others."""
    values = checked_values("response_mask", mask, "uint8", 1)
    if values.shape != versions.shape:
        raise ValueError(f"response_mask {values.shape} must match response_ids {versions.shape}")
    if values.size == 0:
        return
    if np.maximum.reduce(values) > 1:
        raise ValueError("response_mask must be 0/1")
    model = values.view(np.bool_)  # 0/1 bytes: the mask itself, no copy
    if not model.any():
        raise ValueError("response_mask has no model token (1): nothing to train")
    # The versions' sign is the mask (>= 0 at model tokens, < 0 at the others) and none is below
    # -1: elementwise passes over the whole response instead of a gathered copy per test.
    if np.not_equal(versions >= 0, model).any() or np.minimum.reduce(versions) < -1:
        if versions[model].min() < 0:
            raise ValueError("versions must be >= 0 at model tokens (response_mask 1)")
        raise ValueError("versions must be -1 at environment tokens (response_mask 0)")
    # Log-probs are <= 0 (checked first): their sum off the mask is 0.0 only if each one is.
    if np.add.reduce(logprobs, where=~model) != 0.0:
        raise ValueError("logprobs must be 0.0 at environment tokens (response_mask 0)")


@dataclass(frozen=True)
class SegmentArrays:
    """One sample of a trajectory as numpy arrays (`TrajectoryEvent.segments`): an earlier
    segment, or the trajectory's own last sample (whose mask may be None: one model turn)."""

    prompt: np.ndarray  # int32 [P]
    response: np.ndarray  # int32 [R]
    logprobs: np.ndarray  # float32 [R], 0.0 at environment tokens
    versions: np.ndarray  # int32 [R], -1 at environment tokens
    mask: np.ndarray | None  # uint8 [R], 1 at the model's tokens; None: every token the model's

    @property
    def trained(self) -> np.ndarray | None:
        """bool [R]: the model's tokens; None when every one is."""
        return None if self.mask is None else self.mask == 1

    @classmethod
    def of(cls, segment: Segment) -> SegmentArrays:
        return cls(
            segment.prompt_ids.numpy(),
            segment.response_ids.numpy(),
            segment.logprobs.numpy(),
            segment.versions.numpy(),
            segment.response_mask.numpy(),
        )
