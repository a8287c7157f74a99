"""What the collective's source (`engines.collective.CollectiveSource`), its receivers
(`engines.collective.CollectiveReceiver`), the other trainer ranks (`engines.collective_peer`)
and the engine workers (`engines.collective_engine`) share: the settings, the results, a
process group of its own per epoch (`_Group`, opened by `_open_group`, dropped by `_drop`), the
waits that bound every broadcast and store key (`_wait`, `_poll`, `_until`), and a sender's part
of a bucket-mode attempt (`send_buckets`). Nothing here coordinates an attempt: the flow is
drawn in `engines.collective` and docs/weights.md, "Collective transport".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, TypeAlias

import torch
import torch.distributed as dist

from engines.collective_plan import ALIGN, pieces

if TYPE_CHECKING:
    # The group objects `_open_group` makes (`dist.Backend` is the enum of backend names).
    ProcessGroupBackend: TypeAlias = dist.ProcessGroupGloo | dist.ProcessGroupNCCL

_POLL_S = (0.0001, 0.005)  # polling a key or a broadcast: first and longest sleep (it doubles)
_ABANDON_CHECK_S = (
    0.2  # a receiver asks the store whether the attempt was abandoned this often per bucket
)
_GRACE_S = 2.0  # our own deadline = the op timeout + this, in case the backend's never fires
_KEEP_VERSIONS = (
    4  # store keys of older versions are deleted (a late receiver then sees "superseded")
)


@dataclass(frozen=True)
class CollectiveSettings:
    """How broadcasts run; the same on the source and every receiver."""

    backend: str = "gloo"
    """`gloo` (CPU, CI) or `nccl` (GPUs; buckets live on `device`)."""
    device: str = "cpu"
    """Where buckets and the receiver's staging buffer live: `cpu` for gloo, `cuda:N` for nccl."""
    bucket_bytes: int = 64 << 20
    """Bytes per broadcast; the source holds two buckets, a receiver one staging buffer of the
    version's size."""
    op_timeout_s: float = 30.0
    """Longest one bucket's broadcast may take before the attempt fails and the group is rebuilt."""
    join_timeout_s: float = 30.0
    """How long the source waits for candidates to check in,
    and a receiver for the source's plan."""
    max_attempts: int = 3
    """Attempts per version (each failure rebuilds the group) before the source gives up on it."""

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"collective backend must be gloo or nccl, not {self.backend!r}")
        if (
            self.bucket_bytes < ALIGN
            or self.op_timeout_s <= 0
            or self.join_timeout_s <= 0
            or self.max_attempts < 1
        ):
            raise ValueError(
                "collective settings: bucket_bytes >= 64, timeouts > 0, max_attempts >= 1"
            )


@dataclass(frozen=True)
class Published:
    """What the source did with one version."""

    version: int
    epoch: int
    members: tuple[str, ...]  # who the version went to (empty: nobody, see `reason`)
    attempts: int
    seconds: float
    nbytes: int
    reason: str = ""
    sent: int = 0
    """Stream bytes this rank broadcast as src (its own tensors), per attempt that got through."""


@dataclass(frozen=True)
class Received:
    """A version that arrived whole. `tensors` view the staging buffer: a new one per receive when
    `into` is None, else one reused (and overwritten) by the next receive."""

    version: int
    tensors: dict[str, torch.Tensor]
    seconds: float
    nbytes: int
    by_src: dict[int, int] = field(default_factory=dict)
    """Stream bytes received from each sending trainer rank."""


@dataclass(frozen=True)
class Missed:
    """This worker did not get the version by broadcast: catch up from the object store or
    filesystem."""

    version: int
    reason: str


def _open_group(
    store: dist.Store, rank: int, size: int, s: CollectiveSettings
) -> ProcessGroupBackend:
    """A process group of its own (not the default one); its rendezvous fails after
    join_timeout_s."""
    if s.backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=s.join_timeout_s))
    # NCCL (untested here: no GPU in CI). The watchdog's timeout is set past our own deadline, so
    # we abort a stuck communicator ourselves before the watchdog would tear the process down.
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=2 * (s.op_timeout_s + _GRACE_S) + s.join_timeout_s)
    group = dist.ProcessGroupNCCL(store, rank, size, opts)
    group.eager_connect_single_device(torch.device(s.device))
    return group


def _until(done: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `done` (sleeps doubling from 0.1 to 5 ms) until it is true
    (True) or `timeout_s` passed (False)."""
    deadline, pause = time.monotonic() + timeout_s, _POLL_S[0]
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, _POLL_S[1])
    return True


def _wait(work: dist.Work, seconds: float, abandoned: Callable[[], bool] = lambda: False) -> None:
    """Wait for one broadcast, at most `seconds` + grace; raises on failure, timeout or abandon.

    Polls `is_completed` rather than `work.wait(timeout)`: NCCL takes a wait that times out for
    a failed collective (it aborts the communicator and may take the process down)."""
    checked = [time.monotonic()]

    def done() -> bool:
        if time.monotonic() - checked[0] > _ABANDON_CHECK_S:
            checked[0] = time.monotonic()
            if abandoned():
                raise TimeoutError("the source ended this attempt")
        return work.is_completed()

    if not _until(done, seconds + _GRACE_S):
        raise TimeoutError(f"broadcast still pending after {seconds + _GRACE_S:.0f} s")
    work.wait()  # returns at once, or raises the op's own error


@dataclass
class _Group:
    """One epoch's process group and its last broadcast."""

    epoch: int
    members: tuple[str, ...]
    backend: ProcessGroupBackend
    pending: dist.Work | None = None

    def broadcast(self, buf: torch.Tensor, src: int, timeout_s: float) -> dist.Work:
        # c10d backends have `broadcast` at runtime; torch's stubs leave it out.
        self.pending = self.backend.broadcast(  # type: ignore[union-attr]
            buf, src, timedelta(seconds=timeout_s)
        )
        return self.pending

    def settled(self) -> bool:
        return self.pending is None or self.pending.is_completed()


_parked: list[
    _Group
] = []  # dropped with a broadcast pending: destroying a gloo group would block until it ends


def _drop(group: _Group | None) -> None:
    _parked[:] = [g for g in _parked if not g.settled()]
    if group is not None and not group.settled():
        group.backend.abort()  # NCCL interrupts the op; gloo lets it run to its own timeout
        _parked.append(group)


def _poll(
    store: dist.Store, key: str, timeout_s: float, gone: Callable[[], bool] = lambda: False
) -> str | None:
    """The key's value once set; None after `timeout_s` or as soon as `gone()`."""
    _until(lambda: store.check([key]) or gone(), timeout_s)
    return store.get(key).decode() if store.check([key]) else None


def send_buckets(
    group: _Group, rank: int, plan: dict, tensors: Mapping[str, torch.Tensor],
    bufs: list[torch.Tensor], s: CollectiveSettings,
) -> tuple[int, list[torch.Tensor]]:  # fmt: skip
    """A sender's part of one attempt: every bucket of `plan`, in order. Its own (src == `rank`)
    packed from `tensors` (bucket k+1 packed while k is on the wire: two buffers); the other
    senders' buckets received into the same buffers and dropped (a broadcast takes every member
    of the group). Returns (bytes this rank sent, the buffers, kept for the next version)."""
    slots, buckets = plan["slots"], [tuple(b) for b in plan["buckets"]]
    size = max((hi - lo for _, lo, hi in buckets), default=0)
    if bufs[0].numel() < size:  # kept across versions: fresh pages cost as much as the copy
        bufs = [torch.empty(size, dtype=torch.uint8, device=s.device) for _ in range(2)]
    flat = {
        name: t.detach().contiguous().reshape(-1).view(torch.uint8) for name, t in tensors.items()
    }
    sent, work = 0, None
    for k, (src, lo, hi) in enumerate(buckets):
        buf = bufs[k % 2][: hi - lo]
        if src == rank:
            for i, at, dst, n in pieces(slots, lo, hi):
                buf[dst : dst + n].copy_(flat[slots[i][0]][at : at + n])
            sent += hi - lo
        if work is not None:
            _wait(work, s.op_timeout_s)
        work = group.broadcast(buf, src, s.op_timeout_s)
    if work is not None:
        _wait(work, s.op_timeout_s)
    return sent, bufs
