"""One msgpack codec for every event, with a registry of types, versions and upgrades.

An event is a msgpack map of its fields; nested models are maps, tensors carry their data
as msgpack `bin`. Decoding checks the type and version before pydantic validates the
fields, and runs the registered upgrades on an event written by an older schema (each below
`register_upgrade`, one per version step; tests/golden holds a file of every version).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

from schemas.batch_event import BatchEvent
from schemas.events import Event, PromptEvent, RewardEvent, TrajectoryEvent
from schemas.group_events import RewardGroupEvent, TrajectoryGroupEvent
from schemas.weight_event import WeightVersionEvent

E = TypeVar("E", bound=Event)
Upgrade = Callable[[dict[str, Any]], dict[str, Any]]

EVENT_TYPES: tuple[type[Event], ...] = (
    PromptEvent,
    TrajectoryEvent,
    TrajectoryGroupEvent,
    RewardEvent,
    RewardGroupEvent,
    BatchEvent,
    WeightVersionEvent,
)
"""The events of a run: the five flows' (a trajectory and a reward also as a whole group,
`schemas.group_events`)."""
REGISTRY: dict[str, type[Event]] = {cls.TYPE: cls for cls in EVENT_TYPES}
# (type, version) -> function turning a map of that version into one of version + 1.
UPGRADES: dict[tuple[str, int], Upgrade] = {}


class DecodeError(ValueError):
    """Bytes that are not a valid event; retrying cannot help (the message goes to dead)."""

    def __init__(self, reason: str) -> None:
        # One line, cut: the reason names keys and values of the poison itself, and becomes a
        # log line and a dead letter's header.
        super().__init__(" ".join(reason.split())[:500])


def _short(value: object) -> str:
    """repr(value), cut: a reason is one log line and one header, whatever the poison holds."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def register_upgrade(type_name: str, from_version: int) -> Callable[[Upgrade], Upgrade]:
    """Register `fn(fields) -> fields` lifting `type_name` from `from_version` to the next."""

    def wrap(fn: Upgrade) -> Upgrade:
        UPGRADES[(type_name, from_version)] = fn
        return fn

    return wrap


@register_upgrade(TrajectoryEvent.TYPE, 1)
def trajectory_v1(fields: dict[str, Any]) -> dict[str, Any]:
    """Version 2 added `response_mask`: a version-1 trajectory is all model tokens (None). A
    version-1 map that names a mask is no version 1: refused, not read as a masked version 2."""
    if "response_mask" in fields:
        raise DecodeError(f"{TrajectoryEvent.TYPE} schema_version 1 has no response_mask")
    return {**fields, "response_mask": None}


@register_upgrade(TrajectoryEvent.TYPE, 2)
def trajectory_v2(fields: dict[str, Any]) -> dict[str, Any]:
    """Version 3 added `earlier` (an episode's samples before its last): a version-2 trajectory
    is one sample. A version-2 map that names them is no version 2: refused, not read as a
    version 3."""
    if "earlier" in fields:
        raise DecodeError(f"{TrajectoryEvent.TYPE} schema_version 2 has no earlier segments")
    return {**fields, "earlier": ()}


@register_upgrade(RewardEvent.TYPE, 1)
def reward_v1(fields: dict[str, Any]) -> dict[str, Any]:
    """Version 2 holds a version-2 trajectory: the nested version-1 one is upgraded with it (a
    nested map that is not a version-1 trajectory is left for validation to refuse)."""
    nested = fields.get("trajectory")
    if not isinstance(nested, dict) or type(nested.get("schema_version")) is not int:
        return fields
    if nested["schema_version"] != 1:
        return fields
    return {**fields, "trajectory": {**trajectory_v1(nested), "schema_version": 2}}


@register_upgrade(RewardEvent.TYPE, 2)
def reward_v2(fields: dict[str, Any]) -> dict[str, Any]:
    """Version 3 added `turn_rewards`: a version-2 reward has none (the outcome alone). A
    version-2 map that names them is no version 2: refused, not read as a version 3."""
    if "turn_rewards" in fields:
        raise DecodeError(f"{RewardEvent.TYPE} schema_version 2 has no turn_rewards")
    return {**fields, "turn_rewards": None}


@register_upgrade(BatchEvent.TYPE, 1)
def batch_v1(fields: dict[str, Any]) -> dict[str, Any]:
    """Version 2 added `token_rewards`: a version-1 batch has none. A version-1 map that names
    them is no version 1: refused, not read as a version 2."""
    if "token_rewards" in fields:
        raise DecodeError(f"{BatchEvent.TYPE} schema_version 1 has no token_rewards")
    return {**fields, "token_rewards": None}


@register_upgrade(BatchEvent.TYPE, 2)
def batch_v2(fields: dict[str, Any]) -> dict[str, Any]:
    """Version 3 added `solved_rate` (agent episodes): a version-2 batch has none. A version-2
    map that names it is no version 2: refused, not read as a version 3."""
    if "solved_rate" in fields:
        raise DecodeError(f"{BatchEvent.TYPE} schema_version 2 has no solved_rate")
    return {**fields, "solved_rate": None}


@register_upgrade(RewardEvent.TYPE, 3)
def reward_v3(fields: dict[str, Any]) -> dict[str, Any]:
    """Version 4 holds a version-3 trajectory (the nested version-2 one is upgraded with it) and
    added `earlier_ref_logprobs` (none: a version-3 trajectory has no earlier segments). A
    version-3 map that names them is no version 3: refused, not read as a version 4."""
    if "earlier_ref_logprobs" in fields:
        raise DecodeError(f"{RewardEvent.TYPE} schema_version 3 has no earlier_ref_logprobs")
    fields = {**fields, "earlier_ref_logprobs": ()}
    nested = fields.get("trajectory")
    if not isinstance(nested, dict) or type(nested.get("schema_version")) is not int:
        return fields  # not a trajectory: left for validation to refuse
    if nested["schema_version"] != 2:
        return fields
    return {**fields, "trajectory": {**trajectory_v2(nested), "schema_version": 3}}


def _fields(value: object) -> dict[str, Any]:
    """msgpack's hook for what it cannot pack itself: a nested model packs as its fields."""
    if isinstance(value, BaseModel):
        return value.__dict__
    raise TypeError(f"an event field holds a {type(value).__name__}, which msgpack cannot encode")


def encode(event: Event) -> bytes:
    # Packs the models' own field dicts, nested ones through `default`: the same bytes as
    # packing `model_dump()` (tests/golden), at half the cost, since no dict is built first.
    return msgpack.packb(event, default=_fields, use_bin_type=True)


def decode(data: bytes, expected: type[E] = Event) -> E:  # type: ignore[assignment]
    """Bytes -> event. Raises DecodeError with a one-line reason for anything invalid."""
    try:
        fields = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise DecodeError(f"not msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(fields, dict):
        raise DecodeError(f"event must be a msgpack map, got {type(fields).__name__}")
    type_name, version = fields.get("type"), fields.get("schema_version")
    cls = REGISTRY.get(type_name) if isinstance(type_name, str) else None
    if cls is None or not isinstance(type_name, str):  # the second: implied, narrows for mypy
        raise DecodeError(f"unknown event type {_short(type_name)}")
    if not isinstance(version, int) or isinstance(version, bool):
        raise DecodeError(f"{type_name}: schema_version must be an integer, got {_short(version)}")
    if version > cls.VERSION:
        raise DecodeError(
            f"{type_name} schema_version {version} is newer than this worker's {cls.VERSION}"
        )
    while version < cls.VERSION:
        upgrade = UPGRADES.get((type_name, version))
        if upgrade is None:
            raise DecodeError(
                f"{type_name} schema_version {version} has no upgrade to {version + 1}"
            )
        fields = {**upgrade(fields), "schema_version": version + 1}
        version += 1
    if not issubclass(cls, expected):
        # `expected` may be a base of several (a stream of samples' or groups' events).
        names = " or ".join(t.TYPE for t in EVENT_TYPES if issubclass(t, expected))
        raise DecodeError(f"expected {names or expected.__name__} here, got {type_name}")
    try:
        return cls.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "event"
        raise DecodeError(
            f"{type_name}: {where}: {first['msg']} ({exc.error_count()} error(s))"
        ) from None
