"""A whole group (one prompt's n samples) as one event: on `trajectories`, then `rewards` and
`scored`, in place of n per-sample events.

    rollout (batched engine): the prompt's n samples end together
        -> one TrajectoryGroupEvent  id <prompt id>/group  (Nats-Msg-Id: stored once)
    reward: scores its n samples together -> one RewardGroupEvent, same id
    reference: each sample's segments in one forward batch -> one RewardGroupEvent on `scored`
    buffer: holds the group's n samples under the one message, acked (or dropped) together

Why: every event costs each stage a publish, a server store, a delivery, an ack and a decode
whatever it holds, and per sample that was most of the job's CPU on a toy model
(`ops.bench.learn`: about 1.45 ms a sample, nats-py's flusher 40% of the reward worker's and
the buffer's time). A group of 8 pays it once.

A partial group stays per-sample: continuous admission (`rollout.continuous`) and agent
episodes store each sample as soon as it ends (`TrajectoryEvent`, `RewardEvent`), so its reward
starts at once and a kill loses none that ended. Readers take `each()` of either, and the
buffer counts, dedups (by sample id) and trains samples, whatever carried them. A group whose
event would pass the server's payload limit goes per-sample too (`consumers.group_publish`).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import ValidatorFunctionWrapHandler, WrapValidator, model_validator

from schemas.events import RewardEvent, Rewards, Trajectories, TrajectoryEvent

M = TypeVar("M", TrajectoryEvent, RewardEvent)


def group_id(prompt_id: str) -> str:
    """The id of a group's events (dedup: a re-published group is stored once); a sample's is
    `<prompt id>/<sample index>`, so the two never meet."""
    return f"{prompt_id}/group"


def prompt_of(event_id: str) -> str:
    """The prompt id in the id of a trajectory or reward event, a sample's or a group's."""
    return event_id.rsplit("/", 1)[0]


def _once(cls: type[M]) -> WrapValidator:
    """A member given as an instance is taken as it is (it was checked when it was made, and
    pydantic would rerun its `after` validators: a second full check of every sample); a map
    (read from the wire) is validated. As `schemas.events._checked_once` for a reward's
    trajectory."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> M:
        if type(value) is cls:
            return value
        checked: M = handler(value)
        return checked

    return WrapValidator(check)


def _whole(kind: str, prompt_id: str, event_id: str, members: list[TrajectoryEvent]) -> None:
    """A group event holds each sample of its prompt once, in order: sample i at i."""
    if event_id != group_id(prompt_id):
        raise ValueError(f"id {event_id!r} must be {group_id(prompt_id)!r}")
    if not members:
        raise ValueError(f"a {kind} group holds at least one sample")
    size = members[0].group_size
    if len(members) != size:
        raise ValueError(f"{len(members)} samples for a group of {size}")
    for i, t in enumerate(members):
        if t.prompt_id != prompt_id or t.sample_index != i or t.group_size != size:
            raise ValueError(
                f"sample {i} is {t.id!r} of a group of {t.group_size}: a {kind} group holds "
                f"{prompt_id}/0 .. {prompt_id}/{size - 1} in order"
            )


class TrajectoryGroupEvent(Trajectories):
    """Every sample of one prompt, generated (`schemas.group_events`)."""

    TYPE: ClassVar[str] = "jetrl.trajectory_group"
    VERSION: ClassVar[int] = 1
    type: Literal["jetrl.trajectory_group"] = "jetrl.trajectory_group"
    schema_version: Literal[1] = 1

    prompt_id: str
    """Id of the PromptEvent; also the group id."""
    samples: tuple[Annotated[TrajectoryEvent, _once(TrajectoryEvent)], ...]
    """The group's samples, sample i at position i."""

    def each(self) -> tuple[TrajectoryEvent, ...]:
        return self.samples

    @model_validator(mode="after")
    def _complete(self) -> TrajectoryGroupEvent:
        _whole("trajectory", self.prompt_id, self.id, list(self.samples))
        if any(t.run != self.run for t in self.samples):
            raise ValueError(f"a sample of another run than {self.run!r}")
        return self


class RewardGroupEvent(Rewards):
    """Every sample of one prompt, scored (and on `scored`, with reference log-probs)."""

    TYPE: ClassVar[str] = "jetrl.reward_group"
    VERSION: ClassVar[int] = 1
    type: Literal["jetrl.reward_group"] = "jetrl.reward_group"
    schema_version: Literal[1] = 1

    prompt_id: str
    """Id of the PromptEvent; also the group id."""
    rewards: tuple[Annotated[RewardEvent, _once(RewardEvent)], ...]
    """The group's scored samples, sample i at position i."""

    def each(self) -> tuple[RewardEvent, ...]:
        return self.rewards

    @model_validator(mode="after")
    def _complete(self) -> RewardGroupEvent:
        _whole("reward", self.prompt_id, self.id, [r.trajectory for r in self.rewards])
        if any(r.run != self.run for r in self.rewards):
            raise ValueError(f"a sample of another run than {self.run!r}")
        return self
