"""The events of a run's five flows, each a frozen pydantic model with the common envelope.

Ids are deterministic so that `Nats-Msg-Id` dedup and the consumers' own seen-sets make
every publish idempotent (so a retry or a redelivery is stored once):
    prompt      <run>/<epoch>/<index>
    trajectory  <prompt id>/<sample index>     (its RewardEvent reuses the same id)
    group       <prompt id>/group              (a whole group's trajectories, then rewards)
    batch       <run>/step/<step>/<dp rank>/<micro index>
    weights     <run>/weights/<version>/<content digest>   (a resumed trainer's versions are new)

The batch event is in `schemas.batch_event`; the weight event, with its manifest and shards,
in `schemas.weight_event`; a whole group's trajectories or rewards in `schemas.group_events`;
`EVENT_TYPES` (all of them) in `schemas.codec`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)

from schemas.array_checks import (
    at_least,
    checked_values,
    log_probs,
    non_negative,
    vectors,
)
from schemas.segment import Segment, SegmentArrays, masked_tokens
from schemas.tensor import Tensor
from schemas.turn_rewards import check_turn_rewards

FinishReason = Literal["stop", "length", "abort", "error"]
MAX_GROUP = 1024
"""Most samples per prompt (a GRPO group)."""
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
"""A token id as it travels in int32 arrays."""


class Event(BaseModel):
    """The envelope every event carries."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    TYPE: ClassVar[str]
    VERSION: ClassVar[int]

    id: str = Field(min_length=1, max_length=512)
    """Deterministic event id, sent as Nats-Msg-Id."""
    run: str = Field(min_length=1, max_length=64)
    """Run id; every subject of the run carries it."""
    time: float = Field(default_factory=time.time, allow_inf_nan=False)
    """Creation time, unix seconds."""
    source: str = ""
    """Worker id of the producer of this event (host:pid:role)."""
    type: str
    """Event type name, e.g. jetrl.trajectory (each event class fixes it)."""
    schema_version: int
    """Version of this event's schema (each event class fixes it)."""


class SamplingParams(BaseModel):
    """How to sample one prompt's responses."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Softmax temperature; behaviour log-probs are taken at this temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    max_tokens: int = Field(16, ge=1, le=1 << 20)
    """Most response tokens to generate."""
    stop_token_ids: tuple[TokenId, ...] = ()
    """Token ids that end a response (the tokenizer's eos always does)."""


class PromptEvent(Event):
    """One prompt to sample `n` responses for."""

    TYPE: ClassVar[str] = "jetrl.prompt"
    VERSION: ClassVar[int] = 1
    type: Literal["jetrl.prompt"] = "jetrl.prompt"
    schema_version: Literal[1] = 1

    epoch: int = Field(ge=0)
    """Pass over the dataset this prompt belongs to."""
    index: int = Field(ge=0)
    """Position of the prompt in the epoch's (shuffled) order."""
    prompt: str | None = None
    """Plain text prompt, tokenized by the rollout worker."""
    messages: tuple[dict[str, str], ...] | None = None
    """Chat messages, rendered with the tokenizer's chat template by the rollout worker."""
    token_ids: Tensor | None = None
    """Prompt token ids (int32 [L]); when set, used as-is."""
    task: dict[str, Any] = {}
    """Task fields the reward function needs (answer, kind, ...)."""
    n: int = Field(1, ge=1, le=MAX_GROUP)
    """Samples to draw for this prompt (the GRPO group size)."""
    sampling: SamplingParams = SamplingParams()
    """Sampling parameters."""
    admitted_version: int = Field(0, ge=0)
    """Latest weight version when the gate admitted this prompt."""

    @model_validator(mode="after")
    def _has_input(self) -> PromptEvent:
        if self.prompt is None and self.messages is None and self.token_ids is None:
            raise ValueError("a prompt needs one of prompt, messages or token_ids")
        if self.token_ids is not None:
            ids = checked_values("token_ids", self.token_ids, "int32", 1)
            if ids.size == 0:
                raise ValueError("token_ids is empty")
            at_least("token_ids", ids, 0)
        return self


class Trajectories(Event):
    """What the `trajectories` stream carries: one sample (`TrajectoryEvent`) or a whole group
    (`schemas.group_events.TrajectoryGroupEvent`); a reader takes `each()` either way."""

    def each(self) -> tuple[TrajectoryEvent, ...]:
        """The samples this event carries, in sample order."""
        raise NotImplementedError


class Rewards(Event):
    """What the `rewards` and `scored` streams carry: one scored sample (`RewardEvent`) or a
    whole group (`schemas.group_events.RewardGroupEvent`); a reader takes `each()` either way."""

    def each(self) -> tuple[RewardEvent, ...]:
        """The scored samples this event carries, in sample order."""
        raise NotImplementedError


class TrajectoryEvent(Trajectories):
    """One sampled response to a prompt, with what training needs from generation.

    The response of a multi-turn episode mixes the model's tokens (trained) with the
    environment's and the chat template's (a tool result, the next turn's header: not trained),
    told apart by `response_mask`. Which tokens count is decided here once, for every reader:
    `trained_mask` and `trained_versions`.

    An episode whose render stopped extending its tokens left earlier samples: they travel in
    `earlier` (`schemas.segment`), and the fields below are its last sample. Every sample is
    trained: `segments` lists them all for every reader.

    Version 2 added `response_mask`; a version-1 event reads as one with no mask (every token
    the model's), through the upgrade in `schemas.codec`. Version 3 added `earlier`: a version-2
    reader would train the last sample alone, so it refuses the event by its version; a
    version-2 event reads as one with none.
    """

    TYPE: ClassVar[str] = "jetrl.trajectory"
    VERSION: ClassVar[int] = 3
    type: Literal["jetrl.trajectory"] = "jetrl.trajectory"
    schema_version: Literal[3] = 3

    prompt_id: str
    """Id of the PromptEvent; also the group id."""
    sample_index: int = Field(ge=0)
    """Index of this sample in its group."""
    group_size: int = Field(ge=1, le=MAX_GROUP)
    """Samples in the group (the prompt's n)."""
    prompt_ids: Tensor
    """Prompt token ids, int32 [P]."""
    response_ids: Tensor
    """Response token ids, int32 [R]."""
    logprobs: Tensor
    """Behaviour log-prob of each response token, float32 [R]."""
    versions: Tensor
    """Weight version that generated each response token, int32 [R]."""
    response_text: str = ""
    """Decoded response, so reward workers need no tokenizer."""
    finish_reason: FinishReason = "stop"
    """Why generation ended."""
    task: dict[str, Any] = {}
    """The prompt's task fields, carried for the reward function."""
    engine: str = ""
    """Rollout engine that produced it (hf, vllm, sglang)."""
    timings: dict[str, float] = {}
    """Seconds spent per phase (queue, generate, ...)."""
    response_mask: Tensor | None = None
    """uint8 [R]: 1 where response token t is the model's (sampled, trained), 0 where the
    environment or the chat template put it (a tool result, the next turn's header: not trained).
    At a 0 the token's `logprobs` is 0.0 and its `versions` -1 (not generated). None: every
    response token is the model's (one turn)."""
    earlier: tuple[Segment, ...] = ()
    """An agent episode's samples before its last one (its render stopped extending the tokens
    so far: a template that drops earlier reasoning), in order; each is trained as its own row
    with the episode's advantage. Empty: the trajectory is one sample."""

    def each(self) -> tuple[TrajectoryEvent, ...]:
        return (self,)

    def segments(self) -> list[SegmentArrays]:
        """Every sample of the trajectory, in order: the `earlier` ones, then its own."""
        own = SegmentArrays(
            self.prompt_ids.numpy(),
            self.response_ids.numpy(),
            self.logprobs.numpy(),
            self.versions.numpy(),
            None if self.response_mask is None else self.response_mask.numpy(),
        )
        return [*(SegmentArrays.of(s) for s in self.earlier), own]

    def trained_mask(self) -> np.ndarray:
        """bool [R]: True on the response tokens the model generated, those that train, of the
        trajectory's own (last) sample (`segments` has every sample's)."""
        if self.response_mask is None:
            return np.ones(self.response_ids.shape[0], dtype=bool)
        return self.response_mask.numpy() == 1

    def trained_versions(self) -> np.ndarray:
        """int32 [N]: the weight versions of the trained tokens of every segment (`earlier`
        first), the only ones a staleness bound or a sample's version may count (an environment
        token's -1 is no version)."""
        versions = self.versions.numpy()
        own = versions if self.response_mask is None else versions[self.trained_mask()]
        if not self.earlier:
            return own
        earlier = [s.versions.numpy()[s.trained_mask()] for s in self.earlier]
        return np.concatenate([*earlier, own])

    @model_validator(mode="after")
    def _aligned(self) -> TrajectoryEvent:
        r = self.response_ids.shape
        if len(r) != 1 or self.logprobs.shape != r or self.versions.shape != r:
            raise ValueError(
                f"response_ids {r}, logprobs {self.logprobs.shape} and versions "
                f"{self.versions.shape} must be equal 1-D"
            )
        if len(self.prompt_ids.shape) != 1:
            raise ValueError(f"prompt_ids must be 1-D, got shape {self.prompt_ids.shape}")
        if self.sample_index >= self.group_size:
            raise ValueError(f"sample_index {self.sample_index} outside group of {self.group_size}")
        # The buffer groups by prompt id and sample index and dedups by id: they must agree.
        if self.id != f"{self.prompt_id}/{self.sample_index}":
            raise ValueError(f"id {self.id!r} must be <prompt_id>/<sample_index>")
        ints = {
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "versions": self.versions,
        }
        vectors("int32", ints)
        if self.prompt_ids.shape == (0,):
            raise ValueError("prompt_ids is empty: nothing conditions the response")
        vectors("float32", {"logprobs": self.logprobs})
        logprobs = self.logprobs.numpy()
        log_probs("logprobs", logprobs)
        # An empty response is valid: a sample that stopped at once, scored like any other.
        if self.response_mask is None:
            non_negative(ints)
        else:
            non_negative({"prompt_ids": self.prompt_ids, "response_ids": self.response_ids})
            masked_tokens(self.response_mask, self.versions.numpy(), logprobs)
        return self


def _checked_once(value: Any, handler: ValidatorFunctionWrapHandler) -> TrajectoryEvent:
    """A RewardEvent's trajectory: a map is validated (and checked by `_aligned`), an instance
    is taken as it is. pydantic 2.14 reruns a model's `after` validator on an instance given as
    a field: a second full trajectory check per reward the reward worker or the reference stage
    builds from the trajectory it decoded. A frozen instance was checked when it was validated;
    only `model_construct` and `model_copy(update=...)` make one unchecked, which pydantic
    documents as skipping validation and no stage does, and `decode` always checks a trajectory
    read from the wire (a map). Here, not on the trajectory itself: a wrap validator on the
    model costs every trajectory decode about 1 µs."""
    if type(value) is TrajectoryEvent:
        return value
    trajectory: TrajectoryEvent = handler(value)
    return trajectory


class RewardEvent(Rewards):
    """A scored trajectory. A failed score still travels, so the group can be accounted for.

    Version 2 carries a version-2 trajectory (which may hold a `response_mask`): a version-1
    reader must refuse it by its version, not fail on the nested one. Version 3 added
    `turn_rewards`: a reader that dropped them would train the episode without its per-turn
    credit, so an older reader refuses it by its version. Version 4 carries a version-3
    trajectory (which may hold `earlier` segments) and added `earlier_ref_logprobs`.
    `schemas.codec` upgrades an older event, its trajectory with it.
    """

    TYPE: ClassVar[str] = "jetrl.reward"
    VERSION: ClassVar[int] = 4
    type: Literal["jetrl.reward"] = "jetrl.reward"
    schema_version: Literal[4] = 4

    trajectory: Annotated[TrajectoryEvent, WrapValidator(_checked_once)]
    """The trajectory that was scored."""
    reward: float = Field(allow_inf_nan=False)
    """Scalar reward (0.0 when failed)."""
    components: dict[str, FiniteFloat] = {}
    """Named parts of the reward, for logging."""
    failed: bool = False
    """True when scoring raised, hung or the sample was invalid."""
    reason: str = ""
    """Why it failed."""
    ref_logprobs: Tensor | None = None
    """Log-prob of each response token under the frozen reference model, float32 [R] (aligned with
    the trajectory's `logprobs`); set by the reference stage on the `scored` stream, else None.
    At an environment token (the trajectory's `response_mask` 0) any log-prob is accepted and
    none is read: the reference stage scores every token without knowing the mask, and the KL
    (in the reward or the loss) and the batch take only the trained tokens'."""
    turn_rewards: Tensor | None = None
    """With `agent.turn_rewards`: float32 [K], the environment's reward for each model turn of
    the response, in order (K: the runs of 1s in the trajectory's `response_mask`), 0 for a turn
    that ended the episode or was answered by tools; `reward` stays the outcome. The buffer puts
    reward k on the last token of turn k (`schemas.turn_rewards`). None: the outcome alone.
    A trajectory with `earlier` segments: K counts the model turns of every segment, in order
    (the earlier segments' first)."""
    earlier_ref_logprobs: tuple[Tensor, ...] = ()
    """With `ref_logprobs`: float32 [R_i] for each of the trajectory's `earlier` segments, as
    `ref_logprobs` for its own response; empty when it has none, or without the reference."""

    def each(self) -> tuple[RewardEvent, ...]:
        return (self,)

    def ref_segments(self) -> list[np.ndarray] | None:
        """float32 [R_i] reference log-probs of each of `trajectory.segments()`; None: none."""
        if self.ref_logprobs is None:
            return None
        return [*(t.numpy() for t in self.earlier_ref_logprobs), self.ref_logprobs.numpy()]

    @model_validator(mode="after")
    def _same_id(self) -> RewardEvent:
        if self.id != self.trajectory.id:
            raise ValueError(f"id {self.id!r} must be its trajectory's id {self.trajectory.id!r}")
        t = self.trajectory
        if self.turn_rewards is not None:
            check_turn_rewards(self.turn_rewards, t.segments())
        if self.ref_logprobs is None and self.earlier_ref_logprobs:
            raise ValueError("earlier_ref_logprobs without ref_logprobs")
        if self.ref_logprobs is not None and len(self.earlier_ref_logprobs) != len(t.earlier):
            raise ValueError(
                f"{len(self.earlier_ref_logprobs)} earlier_ref_logprobs for "
                f"{len(t.earlier)} earlier segments"
            )
        pairs = zip(self.earlier_ref_logprobs, t.earlier, strict=False)  # as many, or none scored
        for i, (scored, segment) in enumerate(pairs):
            name = f"earlier_ref_logprobs[{i}]"
            log_probs(name, checked_values(name, scored, "float32", 1))
            if scored.shape != segment.response_ids.shape:
                raise ValueError(
                    f"{name} {scored.shape} must match its segment's {segment.response_ids.shape}"
                )
        if self.ref_logprobs is not None:
            ref = checked_values("ref_logprobs", self.ref_logprobs, "float32", 1)
            if self.ref_logprobs.shape != self.trajectory.response_ids.shape:
                raise ValueError(
                    f"ref_logprobs {self.ref_logprobs.shape} must match response_ids "
                    f"{self.trajectory.response_ids.shape}"
                )
            log_probs("ref_logprobs", ref)
        return self
