"""Which stored weight versions are still needed, once a new one is announced: the rest go.

A version's bytes stay in the store (object store or directory) only while some worker may
still load them. After announcing version L, the trainer keeps:

- L's delta chain, whole: its full version and every delta up to L (a delta needs its base
  chain). A worker that joins late reads the last event on `weights` (L) and pulls exactly
  these; a worker on the chain applies the deltas after its own version. Without deltas the
  chain is L alone.
- for each live rollout worker serving a version h < L (its membership heartbeat says which):
  the version it loads next, n (the first version after h still stored: the receiver takes
  the announced versions in order, and skips one that is gone), with n's chain, while n is
  within the staleness bound (L - n <= `algorithm.max_staleness`). That is the fetch a worker
  may be in the middle of; one further behind would generate samples the buffer drops, so it
  skips ahead to L instead (its fetch of n fails as missing, and a newer version is there).

Nothing else is needed: the trainer's checkpoint holds its own weights (a resumed trainer
publishes a new full version), and a worker holds what it serves in memory (plus the CPU
copy deltas apply onto). Deleting happens only after L is announced, so a worker that finds
a version gone always finds a newer one announced (and skips, rather than refuse).

`stale_payloads` picks what to delete from what the store holds: any payload of a version up to
L not at a kept location, including those of an earlier trainer process (a resumed trainer
starts a new chain). Payloads of versions above L are spared: another trainer rank may be
writing its shard of L + 1 now.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Published:
    """One version the trainer announced, as the store holds it."""

    version: int
    full_version: int | None
    """The full version of its delta chain (itself for a full one); None: outside any chain."""
    locations: tuple[str, ...]
    """Where its payloads are: one per trainer rank that stored a shard."""


def chain_of(target: Published, published: Sequence[Published]) -> list[Published]:
    """`target` and the versions of its chain before it (what a worker with no copy pulls)."""
    if target.full_version is None:
        return [target]
    return [
        p
        for p in published
        if p.full_version == target.full_version and p.version <= target.version
    ]


def needed(
    published: Sequence[Published], served: Iterable[int | None], max_staleness: int
) -> list[Published]:
    """Of `published` (the versions stored, in the order announced; the last is L), those to
    keep (see the module doc). `served`: the version each live rollout worker serves (None:
    not reported yet; such a worker reads the last event, L)."""
    if not published:
        return []
    latest = published[-1]
    keep = {p.version: p for p in chain_of(latest, published)}
    for have in served:
        if have is None or have >= latest.version:
            continue
        upcoming = next((p for p in published if p.version > have), None)
        if upcoming is None or latest.version - upcoming.version > max_staleness:
            continue
        keep.update((p.version, p) for p in chain_of(upcoming, published))
    return [p for p in published if p.version in keep]


def stale_payloads(
    stored: Iterable[tuple[str, int]], kept: Collection[str], latest: int
) -> list[str]:
    """Of the `stored` payloads (location, version), those to delete: a version up to `latest`
    at no `kept` location."""
    return [where for where, version in stored if version <= latest and where not in kept]
