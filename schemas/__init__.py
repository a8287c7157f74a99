"""Typed events of a jetrl run, their tensor payload and the msgpack codec."""

from schemas.batch_event import BatchEvent
from schemas.codec import DecodeError, decode, encode
from schemas.events import (
    Event,
    PromptEvent,
    RewardEvent,
    Rewards,
    SamplingParams,
    Trajectories,
    TrajectoryEvent,
)
from schemas.group_events import RewardGroupEvent, TrajectoryGroupEvent, group_id, prompt_of
from schemas.segment import Segment
from schemas.tensor import Tensor
from schemas.weight_event import TensorSpec, WeightVersionEvent

__all__ = [
    "BatchEvent",
    "DecodeError",
    "Event",
    "PromptEvent",
    "RewardEvent",
    "RewardGroupEvent",
    "Rewards",
    "SamplingParams",
    "Segment",
    "Tensor",
    "TensorSpec",
    "Trajectories",
    "TrajectoryEvent",
    "TrajectoryGroupEvent",
    "WeightVersionEvent",
    "decode",
    "encode",
    "group_id",
    "prompt_of",
]
