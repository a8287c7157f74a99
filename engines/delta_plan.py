"""Which versions are full, which base a delta is against, what a worker fetches, who encodes what.

Deltas form chains: a full version f, then deltas f+e, f+2e, ... (e = the trainer's
`sync_every`), each against the version published just before it, until the next full
version `full_every` versions later. Chained deltas keep each delta to one step's changes
and let a worker that is current apply one delta onto what it serves, holding no second copy
of the weights. A worker that is off the chain (new, behind a full version, or ahead of the
target after a trainer restart) pulls the chain's full version first, then each delta.

A trainer that starts or resumes holds no base, so its first version is full: chains start
where trainers start, not at multiples of `full_every`, and the events say where (the
version, its base and its chain's full version).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engines.weights import WeightsRefused
from schemas.weight_event import TensorSpec


@dataclass(frozen=True)
class Chain:
    """The trainer's chain in progress: its full version, last version, deltas since the full."""

    full: int
    last: int
    deltas: int = 0


def next_publication(
    version: int, chain: Chain | None, full_every: int
) -> tuple[int | None, Chain]:
    """(base version, or None for a full version; the chain after it) for publishing `version`.

    `chain` is None when the trainer holds no published base (start, resume): full. Otherwise
    a full version is due once the chain holds `full_every` versions (the full one included),
    so `full_every` 1 publishes only full versions and turns deltas off.
    """
    if full_every < 1:
        raise ValueError(f"full_every must be >= 1, got {full_every}")
    if chain is not None and version <= chain.last:
        raise ValueError(f"version {version} is not after the chain's last version {chain.last}")
    if chain is None or chain.deltas + 1 >= full_every:
        return None, Chain(full=version, last=version)
    return chain.last, Chain(full=chain.full, last=version, deltas=chain.deltas + 1)


@dataclass(frozen=True)
class Fetch:
    """One version to fetch: full (base None) or a delta onto `base`."""

    version: int
    base: int | None


def plan_fetch(target: int, full: int, have: int | None, every: int) -> tuple[Fetch, ...]:
    """The versions to fetch, in order, to go from `have` (None: no weights) to `target`.

    `full` is the full version of `target`'s chain and `every` the step between its versions.
    A worker on that chain, behind `target`, applies the deltas after its version; any other
    pulls `full` first, then every delta up to `target`.
    """
    if every < 1 or target < full or (target - full) % every:
        raise ValueError(
            f"version {target} is not on a chain from full version {full} with step {every}"
        )
    if have == target:
        return ()
    on_chain = have is not None and full <= have < target and (have - full) % every == 0
    start = have if on_chain and have is not None else full
    steps = [] if on_chain else [Fetch(full, None)]
    return (*steps, *(Fetch(v, v - every) for v in range(start + every, target + 1, every)))


def assign_shards(sizes: Mapping[str, int], world: int) -> tuple[tuple[str, ...], ...]:
    """Tensor names per rank (rank r encodes `result[r]`), balanced by bytes; deterministic.

    Largest tensor first onto the least loaded rank (lowest rank on a tie): every rank that
    computes it from the same sizes gets the same answer, and the fullest rank exceeds the
    emptiest by at most its own smallest tensor. Names keep `sizes`' order within a shard.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    loads, owner = [0] * world, {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        owner[name] = rank
        loads[rank] += sizes[name]
    return tuple(tuple(name for name in sizes if owner[name] == rank) for rank in range(world))


class ShardLayout(BaseModel):
    """The shards of one published version: which rank's payload carries which tensors."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = Field(ge=0)
    """The version the shards rebuild."""
    base_version: int | None = Field(None, ge=0)
    """The version a delta applies onto; None for a full version."""
    full_version: int = Field(ge=0)
    """The full version the chain starts at (`version` itself for a full version)."""
    shards: tuple[tuple[str, ...], ...] = Field(min_length=1)
    """Tensor names carried by rank 0's payload, rank 1's, ..."""

    @model_validator(mode="after")
    def _chain(self) -> ShardLayout:
        if self.base_version is None and self.full_version != self.version:
            raise ValueError("a full version is its own chain's full version")
        if (
            self.base_version is not None
            and not self.full_version <= self.base_version < self.version
        ):
            raise ValueError("a delta's base must lie in its chain, before it")
        return self

    def check(self, manifest: Sequence[TensorSpec]) -> None:
        """Refuse a layout that does not carry each tensor of `manifest` exactly once."""
        names = [name for shard in self.shards for name in shard]
        expected = {spec.name for spec in manifest}
        if len(names) != len(set(names)) or set(names) != expected:
            dupes = sorted(name for name, n in Counter(names).items() if n > 1)
            raise WeightsRefused(
                f"v{self.version}: shard layout does not carry each tensor once: "
                f"{len(set(names) ^ expected)} missing or extra "
                f"{sorted(set(names) ^ expected)[:3]}, repeated {dupes[:3]}"
            )
