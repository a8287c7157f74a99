"""The progress line before a run's first step: which workers are up, not a step 0 at 0
samples/s.

Until the first step of this process's run comes and while some worker the run expects has
not joined yet, the line says how many have joined (their heartbeat entries in the members
bucket, `bus.membership`):

    [    12s] starting workers (3 of 5 ready; waiting for trainer, rollout)

The expected workers are the local job's fleet (`consumers.fleet_config.local_fleet`): one
process per trainer rank, one buffer, reward and rollout worker, the reference workers when
the run has the stage. A cluster's fleets may bring more; each role counts up to what the
local fleet would have.
"""

from __future__ import annotations

from collections import Counter

from schemas.config import RunConfig


def expected_workers(cfg: RunConfig) -> Counter[str]:
    """The workers of each role the local job starts for `cfg`."""
    expected = Counter({"trainer": cfg.trainer.ranks, "buffer": 1, "reward": 1, "rollout": 1})
    if cfg.reference.enabled:
        expected["reference"] = cfg.reference.workers
    return expected


def all_ready(live: Counter[str] | None, expected: Counter[str]) -> bool:
    """Every expected worker has joined: from then on the line is the ordinary step line, even
    before the first step (groups dropped while step 0 forms show there)."""
    return live is not None and all(live[role] >= count for role, count in expected.items())


def starting_line(live: Counter[str] | None, expected: Counter[str]) -> str:
    """`starting workers (k of n ready; waiting for ...)`; `?` for k when membership cannot be
    read now."""
    n = sum(expected.values())
    if live is None:
        return f"starting workers (? of {n} ready)"
    ready = sum(min(live[role], count) for role, count in expected.items())
    waiting = [role for role, count in expected.items() if live[role] < count]
    line = f"starting workers ({ready} of {n} ready"
    return line + (f"; waiting for {', '.join(waiting)})" if waiting else ")")
