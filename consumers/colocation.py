"""A colocated role's phases on its node's device (`placement: colocated`).

The rollout worker and the trainer of a node each hold one `Phases`; its `enter` and `leave`
bracket every stretch in which the role computes on the device, so that the two never
compute at once (the device lease, `bus.lease`, decides who holds it):

    rollout: batcher -> enter (take the lease, or, holding it, check it is still ours: else
                 fenced, and take it again; the engine takes its memory again) ->
                 generate -> boundary: the trainer waits, or no prompt within GRACE ->
                 leave (the engine gives its memory back; release the lease)
             build: enter -> build the engine -> leave (its memory given back at once)
    trainer: setup (v0 out) and each step's train -> record -> checkpoint -> sync,
                 between enter and leave; collecting batches holds nothing. With
                 `trainer.offload_optimizer` its optimizer state is what it gives back
                 (`OptimizerTurns`): off the device at each leave (after the step's
                 checkpoint), back at each enter (before the step trains)

Fencing: a holder paused past the members TTL is counted dead and its lease taken over, yet
it may wake and go on. Every `enter` while holding (the rollout's, before each batch it
generates) reads the lease first (`Lease.holds`); taken over, the turn ends there (`fenced`:
the engine's memory given back, nothing more computed) and it waits for its turn again. The
trainer enters afresh for each step, so it computes only on a lease it has just taken.

Each start and end of a phase is logged, and appended as a JSON line to the file named by
`JETRL_PHASE_LOG` when it is set (the tests' timeline: `tests/test_colocation.py`). A killed
holder's lease is taken over once its membership expires (`bus.lease`), so a kill in a phase
recovers as in a separated run, later by at most the members TTL.

Stages see the engine only as `Releasable` (`ReleasableEngine`, `ReleasableTrainEngine`);
this module names no engine class.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Callable

from bus.crashpoints import ROLLOUT_HOLDING_DEVICE, TRAINER_HOLDING_DEVICE
from bus.lease import Lease
from bus.runtime import Runtime
from engines.protocols import Releasable, ReleasableTrainEngine
from schemas.kv_records import Phase

log = logging.getLogger("jetrl.colocation")

PHASE_LOG = "JETRL_PHASE_LOG"
"""A file each phase's start and end is appended to, one JSON line each (tests, benches)."""

MIB = 1 << 20

GRACE = 0.1
"""Seconds a rollout holding the device waits for more prompts before giving it back."""

HOLDING: dict[Phase, Callable[[str], None]] = {
    Phase.ROLLOUT: ROLLOUT_HOLDING_DEVICE,
    Phase.TRAIN: TRAINER_HOLDING_DEVICE,
}


def node_device(index: int = 0) -> str:
    """This node's device `index`, as the lease names it: one per node for now."""
    return f"{socket.gethostname()}/{index}"


class Phases:
    """This process's turns on one device, in `phase`; `engine`: what gives its memory back
    between turns (the rollout's engine; the trainer's optimizer state, `OptimizerTurns`), None
    for a role whose memory stays (the trainer's without `trainer.offload_optimizer`).
    """

    def __init__(self, lease: Lease, phase: Phase, engine: Releasable | None = None):
        self.lease, self.phase, self.engine = lease, phase, engine
        self.holding = False
        self.log_path = os.environ.get(PHASE_LOG)

    @classmethod
    async def of(cls, rt: Runtime, phase: Phase) -> Phases | None:
        """The phases of `rt`'s role when the run is colocated, else None."""
        if rt.config.placement != "colocated":
            return None
        members = await rt.js.key_value(rt.topology.members_bucket)
        return cls(Lease(rt.kv, members, node_device(), rt.member.key), phase)

    async def enter(self) -> None:
        """Hold the device (waiting for the other role's turn to end); the engine takes its
        memory again. Entering while holding does nothing, if the lease is still ours: one
        taken over meanwhile (this process was paused past the members TTL and counted dead)
        fences it first (`fenced`), and it waits for its turn like any other."""
        if self.holding:
            if await self.lease.holds():
                return
            await self.fenced()
        waited = await self.lease.acquire(self.phase)
        self.holding = True
        HOLDING[self.phase](f"device {self.lease.device}")
        if self.engine is not None:
            await asyncio.to_thread(self.engine.resume_memory)
        self.record("start", waited)

    async def leave(self) -> None:
        """The engine gives its memory back, then the device is released. Leaving when not
        holding does nothing."""
        if not self.holding:
            return
        if self.engine is not None:
            await asyncio.to_thread(self.engine.release_memory)
        self.record("end", 0.0)
        await self.lease.release()
        self.holding = False

    async def fenced(self) -> None:
        """The lease was taken over while this process believed it held the device: compute
        nothing more on it. The engine gives its memory back (the new holder needs it); the
        lease is not released (it is not ours); the turn is recorded as ended, fenced."""
        log.warning(
            "device %s: the lease was taken over while %s held it (paused past the members "
            "TTL?): its %s turn is fenced; it waits for the device again",
            self.lease.device,
            self.lease.me,
            self.phase.value,
        )
        if self.engine is not None:
            await asyncio.to_thread(self.engine.release_memory)
        self.record("fenced", 0.0)
        self.holding = False

    async def boundary(self, more: Callable[[], bool]) -> None:
        """Between two stretches of work: leave if the other role waits for the device, or if
        no more work comes within `GRACE` s (prompts of one step arrive a few at a time: giving
        the memory back between them would pay a sleep and a wake for nothing)."""
        if not self.holding or await self.lease.wanted():
            await self.leave()
            return
        waited = 0.0
        while not more() and waited < GRACE:
            await asyncio.sleep(GRACE / 10)
            waited += GRACE / 10
        if not more():
            await self.leave()

    def record(self, event: str, waited: float) -> None:
        line = {
            "t": time.time(),
            "event": event,
            "phase": self.phase.value,
            "device": self.lease.device,
            "holder": self.lease.me,
            "waited": round(waited, 4),
        }
        log.info(
            "device %s: %s phase %s (waited %.2f s)",
            line["device"],
            self.phase.value,
            event,
            waited,
        )
        if self.log_path:
            with open(self.log_path, "a") as out:  # one short line: appended whole
                out.write(json.dumps(line) + "\n")


class OptimizerTurns:
    """The trainer's optimizer state as what its `Phases` gives back between turns
    (`trainer.offload_optimizer`): released as each turn ends, after the step's checkpoint (a
    save sees the real state), resumed as the next begins, before the step trains. Each
    release and resume that moves bytes is logged with its size and time; before the first
    step there is no state, and nothing is logged."""

    def __init__(self, engine: ReleasableTrainEngine) -> None:
        self.engine = engine

    def release_memory(self) -> None:
        self.timed("released", self.engine.release_optimizer)

    def resume_memory(self) -> None:
        self.timed("resumed", self.engine.resume_optimizer)

    @staticmethod
    def timed(done: str, call: Callable[[], int]) -> None:
        started = time.perf_counter()
        moved = call()
        if moved:
            seconds = time.perf_counter() - started
            log.info("optimizer state %s (%.1f MiB in %.3f s)", done, moved / MIB, seconds)
