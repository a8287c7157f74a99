"""What a trainer rank says when it starts: from its checkpoint or from nothing, and whether it
replays steps the buffer has already stored.

A trainer that restarts before its first checkpoint starts at step 0 again, but it does not
wait for new work: it reads `batches.<rank>` from its first message and trains the stored steps
again, in order. "starts at step 0" read as if the run had been lost; the line says which:

    rank 0 replays steps 0-41 from stored batches (no checkpoint yet), from batch sequence 1
    rank 0 resumes from its checkpoint at step 40, replaying steps 40-41 from stored batches
    rank 0 starts at step 0, batch sequence 1 (no checkpoint, no stored batches)
"""

from __future__ import annotations

import logging

import nats.errors

from bus.readers import LastStored, Poison
from bus.runtime import Runtime
from bus.topology import BATCHES
from schemas import BatchEvent

log = logging.getLogger("jetrl.trainer")


def start_line(rank: int, step: int, checkpointed: bool, stored: int | None, seq: int) -> str:
    """The start-up line of trainer rank `rank` at `step`, reading from batch sequence `seq`;
    `stored` the last step stored on its batches (None: none)."""
    if checkpointed:
        head = f"rank {rank} resumes from its checkpoint at step {step}"
        if stored is not None and stored >= step:
            return f"{head}, replaying steps {step}-{stored} from stored batches"
        return f"{head}, batch sequence {seq}"
    if stored is not None and stored >= step:
        return (
            f"rank {rank} replays steps {step}-{stored} from stored batches (no checkpoint yet), "
            f"from batch sequence {seq}"
        )
    return (
        f"rank {rank} starts at step {step}, batch sequence {seq} "
        "(no checkpoint, no stored batches)"
    )


async def last_stored_step(rt: Runtime, dp_rank: int) -> int | None:
    """The step of the last batch stored on `batches.<dp_rank>`; None if none (or unreadable)."""
    reader: LastStored[BatchEvent] = LastStored(rt.js, rt.topology, BATCHES, Poison("trainer"))
    try:
        stored = await reader.last(dp_rank)
    except (TimeoutError, nats.errors.Error) as exc:
        log.info("the last stored batch cannot be read now (%r)", exc)
        return None
    return None if stored is None else stored.event.step
