"""What a (re)starting buffer learns from the batch stream: the sample ids already batched, the
next step, a step stored only in part, and the KL coefficient the next step goes on with.

The streams are the state: nothing here is kept in a process's memory across a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bus.readers import Poison, Replay
from bus.runtime import Runtime
from bus.topology import BATCHES
from engines.algorithms.kl import adaptive_kl_coef
from schemas import BatchEvent
from schemas.config import AlgorithmConfig


def next_kl_coef(
    algo: AlgorithmConfig, coef: float | None, kl_mean: float | None, samples: int
) -> float:
    """The KL-in-reward coefficient of the step after one formed with `coef` and KL `kl_mean` over
    `samples` samples: `algorithm.kl_coef` when fixed (or nothing stored yet), else the adaptive
    controller's step (`engines.algorithms.kl.adaptive_kl_coef`)."""
    if coef is None or kl_mean is None or algo.kl_target is None:
        return algo.kl_coef
    return adaptive_kl_coef(coef, kl_mean, algo.kl_target, algo.kl_horizon, samples)


@dataclass
class BatchedSoFar:
    """What the batch stream says: sample ids in whole stored steps, the next step, a half-stored
    step, and the KL coefficient of the next step (KL in reward)."""

    sample_ids: set[str] = field(default_factory=set)
    next_step: int = 0
    partial: tuple[int, tuple[str, ...]] | None = None
    kl_coef: float = 0.0


async def read_batches(rt: Runtime) -> BatchedSoFar:
    """Replay the batch stream once at start-up, up to its last sequence now (the trainer may
    trim its start meanwhile, never its last step)."""
    seen = BatchedSoFar(kl_coef=rt.config.algorithm.kl_coef)
    counts: dict[tuple[int, int], tuple[int, int]] = {}  # (step, rank) -> (stored, micro_count)
    groups: dict[int, tuple[str, ...]] = {}
    sample_ids: dict[int, set[str]] = {}  # step -> the samples its stored micro-batches hold
    kl: dict[int, tuple[float | None, float | None]] = {}  # step -> (its KL coefficient, its KL)
    # Unreadable batches hold nothing of ours: dead-lettered under the buffer, and skipped.
    poison = Poison("buffer", rt.publisher)
    replay: Replay[BatchEvent] = Replay(rt.js, rt.topology, BATCHES, poison, timeout=10)
    async with replay:
        async for stored in replay:
            batch = stored.event
            sample_ids.setdefault(batch.step, set()).update(batch.sample_ids)
            held, _ = counts.get((batch.step, batch.dp_rank), (0, batch.micro_count))
            counts[(batch.step, batch.dp_rank)] = (held + 1, batch.micro_count)
            groups[batch.step] = batch.step_prompt_ids
            kl[batch.step] = (batch.kl_coef, batch.kl_mean)
    if not counts:
        return seen
    last = max(step for step, _ in counts)
    seen.next_step = last + 1
    dp_size = rt.config.trainer.dp_size
    coef, kl_mean = kl[last]
    if any(
        counts.get((last, r), (0, 1))[0] < counts.get((last, r), (0, 1))[1] for r in range(dp_size)
    ):
        seen.partial, seen.next_step = (last, groups[last]), last
        # Its samples come back unacked and must be held again to re-form it: skipped as
        # batched already, their groups would never complete and no step would form again.
        del sample_ids[last]
        # Re-formed with the coefficient it was first formed with (a rank may have trained it).
        seen.kl_coef = coef if coef is not None else rt.config.algorithm.kl_coef
    else:
        seen.kl_coef = next_kl_coef(rt.config.algorithm, coef, kl_mean, len(sample_ids[last]))
    seen.sample_ids = set().union(*sample_ids.values())
    return seen
