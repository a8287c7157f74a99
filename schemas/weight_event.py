"""The weight version event: where one version's bytes are, how they are sent, and the
manifest (name, dtype, shape, sha256 per tensor) a loader checks them against."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import PurePosixPath
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.events import Event
from schemas.tensor import DType, itemsize


class TensorSpec(BaseModel):
    """One tensor of a weight version."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """Parameter name as in the model's state dict."""
    dtype: DType
    """Wire dtype name."""
    shape: tuple[int, ...]
    """Tensor shape."""
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Hex sha256 of the tensor's raw bytes."""


TransportName = Literal["object_store", "filesystem", "collective"]
"""How a weight version's bytes travel (`weights.transport` in the run config)."""
_OBJECT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def _check_location(transport: str, location: str) -> None:
    if transport == "object_store" and not _OBJECT_NAME.fullmatch(location):
        raise ValueError(
            f"object_store location {location[:64]!r} is not an object name (letters, digits, ._-)"
        )
    if transport == "filesystem":
        path = PurePosixPath(location)
        if (
            not path.is_absolute()
            or ".." in path.parts
            or path.suffix != ".safetensors"
            or "\x00" in location
        ):
            raise ValueError(
                f"filesystem location {location[:64]!r} must be an absolute path to a .safetensors "
                "file"
            )


class WeightShard(BaseModel):
    """One trainer rank's payload of a version: where it is, its size, and the tensors it
    carries (`engines.delta_plan.assign_shards`). A delta's shard is a `jetrl-delta/1` payload
    (`engines.weight_delta`); a full version's is a plain safetensors file of its tensors."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    location: str = Field(min_length=1, max_length=4096)
    """Where the payload is, as `WeightVersionEvent.location` says for its transport."""
    total_bytes: int = Field(ge=0)
    """Size of the payload (a safetensors file)."""
    tensors: tuple[str, ...]
    """Names of the manifest's tensors this shard carries (rank 0's shard first)."""


class WeightVersionEvent(Event):
    """Announces that the weights of `version` can be loaded from `location` by `transport`.

    Its id is `<run>/weights/<version>/<digest>` (`announce`): a trainer resumed from a
    checkpoint publishes its versions again, with other bytes at other locations, within the
    stream's dedup window; a version number alone as `Nats-Msg-Id` made the server drop them."""

    TYPE: ClassVar[str] = "jetrl.weights"
    VERSION: ClassVar[int] = 1
    type: Literal["jetrl.weights"] = "jetrl.weights"
    schema_version: Literal[1] = 1

    version: int = Field(ge=0)
    """Weight version = optimizer steps taken."""
    step: int = Field(ge=0)
    """Trainer step the weights were taken at (equal to version)."""
    base_version: int | None = Field(None, ge=0)
    """For a delta: the version the listed tensors apply on top of (older than `version`); None
    for full weights."""
    transport: TransportName = "object_store"
    """Where the bytes are: `object_store` (the run's JetStream object store), `filesystem` (a
    file every reader sees at the same path), `collective` (a torch.distributed broadcast). The
    name `nccl`, which the first schema documented for the last, is read as `collective`."""
    location: str = Field(min_length=1, max_length=4096)
    """object_store: the object's name in the run's bucket (letters, digits, `._-`);
    filesystem: the file's absolute path, ending in `.safetensors`; collective: the trainer's
    rendezvous store, `host:port`."""
    format: Literal["safetensors"] = "safetensors"
    """Serialization of the bytes."""
    manifest: tuple[TensorSpec, ...]
    """Every tensor in the payload with its checksum, each name once."""
    total_bytes: int = Field(ge=0)
    """Size of the payload: at least the tensors' data (a safetensors file adds its header);
    for a delta, the sum of its shards' sizes."""
    full_version: int | None = Field(None, ge=0)
    """With `weights.delta`: the full version the chain of this version starts at (`version`
    itself for a full version); a worker that lacks `base_version` pulls it first, then every
    delta up to `version`. None: published outside a delta chain."""
    shards: tuple[WeightShard, ...] = ()
    """The payloads, one per trainer rank that stored one (`location` and `total_bytes` name the
    first and the sum). Every delta has them; a full version has them when several trainer
    ranks stored it (each a safetensors file of its tensors), else none: its bytes are at
    `location`. collective: the shards of the fallback copy (`fallback_location` names the first),
    each rank's tensors, which that rank also broadcasts."""
    fallback_transport: Literal["object_store", "filesystem"] | None = None
    """collective: the transport the version is also stored with, for a worker that misses the
    broadcast (joined late, dropped from the group); `total_bytes` is that copy's size."""
    fallback_location: str | None = Field(None, min_length=1, max_length=4096)
    """collective: where that copy is, as `location` says for `fallback_transport`."""

    @classmethod
    def announce(cls, **fields: Any) -> WeightVersionEvent:
        """The event of `fields` (all but `id`), its id naming its content (`content_digest`)."""
        draft = cls(id="-", **fields)
        return draft.model_copy(
            update={"id": f"{draft.run}/weights/{draft.version}/{content_digest(draft)}"}
        )

    @model_validator(mode="before")
    @classmethod
    def _old_transport_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("transport") == "nccl":
            return {**data, "transport": "collective"}
        return data

    @model_validator(mode="after")
    def _where(self) -> WeightVersionEvent:
        if self.base_version is not None and self.base_version >= self.version:
            raise ValueError(
                f"base_version {self.base_version} must be older than version {self.version}"
            )
        _check_location(self.transport, self.location)
        if (self.fallback_transport is None) != (self.fallback_location is None):
            raise ValueError("fallback_transport and fallback_location come together")
        if self.fallback_transport is not None and self.fallback_location is not None:
            if self.transport != "collective":
                raise ValueError(
                    f"a fallback copy is for collective versions, not {self.transport}"
                )
            _check_location(self.fallback_transport, self.fallback_location)
        names = [spec.name for spec in self.manifest]
        if len(set(names)) != len(names):
            raise ValueError("manifest names a tensor twice")
        if self.base_version is not None:
            self._check_delta(names)
            return self
        if self.shards:
            if self.transport == "collective" and self.fallback_transport is None:
                raise ValueError(
                    "a collective version's shards are those of its fallback copy, and it has none"
                )
            self._check_shards(names)
        if self.full_version is not None and self.full_version != self.version:
            raise ValueError(
                f"a full version is its own chain's full version, not {self.full_version}"
            )
        data = sum(math.prod(spec.shape) * itemsize(spec.dtype) for spec in self.manifest)
        if self.total_bytes < data:
            raise ValueError(
                f"total_bytes {self.total_bytes} is less than the manifest's {data} "
                "bytes of tensor data"
            )
        return self

    def _check_delta(self, names: list[str]) -> None:
        """A delta names its chain and its shards, which carry every manifest tensor once."""
        assert self.base_version is not None
        if self.full_version is None or not self.full_version <= self.base_version:
            raise ValueError(
                f"a delta on v{self.base_version} needs its chain's full version, "
                "at or before its base"
            )
        if not self.shards:
            raise ValueError("a delta needs its shards")
        self._check_shards(names)

    def _check_shards(self, names: list[str]) -> None:
        """The shards carry every manifest tensor once; `location` and `total_bytes` say theirs."""
        stored, where = self.transport, self.location
        if self.transport == "collective" and self.fallback_transport and self.fallback_location:
            stored, where = (
                self.fallback_transport,
                self.fallback_location,
            )  # the shards are the copy's
        for shard in self.shards:
            _check_location(stored, shard.location)
        carried = [name for shard in self.shards for name in shard.tensors]
        if len(carried) != len(set(carried)) or set(carried) != set(names):
            raise ValueError("the shards do not carry each manifest tensor exactly once")
        if where != self.shards[0].location or self.total_bytes != sum(
            s.total_bytes for s in self.shards
        ):
            raise ValueError(
                "a sharded version's location and total_bytes are its first shard's "
                "and the shards' sum"
            )


DIGEST_CHARS = 16
"""Hex digits of the content digest in a weight event's id (64 bits)."""


def content_digest(event: WeightVersionEvent) -> str:
    """sha256 of what `event` announces: every field but `id`, `time` and `source`. The same
    announcement (a publisher's retry: the same event) has the same digest, so the server
    stores it once; another chain's version (other base, manifest checksums or location) has
    another, so it is stored. Locations are part of it: a payload stored again (a restarted
    trainer's, even of equal bytes) is announced where it is, never deduplicated onto an
    event naming a payload the restarted trainer does not keep."""
    fields = event.model_dump(mode="json", exclude={"id", "time", "source"})
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:DIGEST_CHARS]
