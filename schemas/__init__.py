"""Typed events of a jetrl run, their tensor payload and the msgpack codec."""

from schemas.batch_event import BatchEvent
from schemas.codec import DecodeError, decode, encode
from schemas.events import (
    Event,
    PromptEvent,
    RewardEvent,
    SamplingParams,
    TrajectoryEvent,
)
from schemas.segment import Segment
from schemas.tensor import Tensor
from schemas.weight_event import TensorSpec, WeightVersionEvent

__all__ = [
    "BatchEvent",
    "DecodeError",
    "Event",
    "PromptEvent",
    "RewardEvent",
    "SamplingParams",
    "Segment",
    "Tensor",
    "TensorSpec",
    "TrajectoryEvent",
    "WeightVersionEvent",
    "decode",
    "encode",
]
