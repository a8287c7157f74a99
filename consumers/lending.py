"""Lent capacity (`lend: true`): a trainer that waits for its batches lends its device to
rollout, and takes it back between two tokens when they come.

    trainer.collect waits for step s's batches
      waited > trainer.lend_after (`should_lend`), a version published -> lend():
        the engine takes its memory (resume_memory) -> the last published version loaded if
        the engine's is older -> the engine resumes, the gate opens -> the lent worker fetches
        prompts from the rollout's durable consumer (competing with the rollout pool) ->
        `Rollout.handle`: each sample generated token by token, its trajectory stored, the
        prompt acked once all are (durable, traced, every token's version recorded: ordinary
        rollout, which the buffer bounds by staleness as any other)
      step s's last micro-batch in -> hand_back():
        stop fetching -> the gate closes, the engine pauses between two tokens (at most one
        token's time: `ContinuousEngine.pause`) -> its memory given back -> the trainer trains
      a sync: offer(tensors, v) -> loaded into the engine at the next lend

Weights: the trainer hands over the tensors it has just exported for its own publication,
not the stored copy: the same bytes, already in host memory, with no object-store read (56
MB/s here for a stored version, docs/weights.md) and no wait for the announcement; and only
published versions, so every lent token's version is one the run knows. A restarted trainer
lends only once it has published a version in this process.

Samples still in flight at a hand-back stay paused (their prompts held and heartbeaten by the
lent worker) and go on at the next lend, with the weights then loaded (partial rollout); were
the trainer never to wait again, the buffer would wait for their groups, the trainer for its
batch, and it lends again after `lend_after`. What the trainer process holds when it ends is
cancelled unacked, and redelivered after the consumer's ack_wait.

Each lend and hand-back is logged, and appended to `JETRL_PHASE_LOG` when set (phase "lend",
with `stopped`: seconds from the batch's arrival to no token computing, and `released`: to
the engine's memory given back): `tests/test_lending_job.py` reads them. The engine is seen
only through `ContinuousEngine` and `ReleasableEngine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import cast

import torch
from nats.aio.msg import Msg
from transformers import AutoTokenizer

from bus.crashpoints import TRAINER_LENDING
from bus.runtime import Runtime
from bus.stage import Helper
from bus.topology import PROMPTS
from bus.worker import Worker, WorkerOptions
from consumers.colocation import PHASE_LOG
from consumers.rollout import Rollout, releasable
from engines.build import build_rollout_engines
from engines.protocols import ContinuousEngine
from schemas import PromptEvent

log = logging.getLogger("jetrl.lending")

FETCH_TIMEOUT = 0.2
"""Seconds one lent fetch waits: a fetch open when the batch comes may still hand over
prompts; short, it holds few of them past the hand-back."""


def should_lend(waited: float, lend_after: float, lending: bool, has_weights: bool) -> bool:
    """Whether a trainer that has waited `waited` s for its batches lends its device now."""
    return not lending and has_weights and waited >= lend_after


class Lender:
    """The trainer's lent rollout: a `Rollout` on its own engine, and a worker over the
    prompts that fetches only while lending."""

    def __init__(self, rt: Runtime, rollout: Rollout) -> None:
        self.rt, self.rollout, self.copies = rt, rollout, rollout.copies
        self.engine = releasable(rollout.engine)
        self.stepwise = cast(ContinuousEngine, rollout.engine)
        self.lend_after = rt.config.trainer.lend_after
        self.fetching = asyncio.Event()
        self.lending = False
        self.quiet: contextlib.AsyncExitStack | None = None
        """Open while the engine is quiesced (`EngineCopies.quiesced`): not lending."""
        self.weights: tuple[dict[str, torch.Tensor], int] | None = None
        """The last version the trainer published, to load at the next lend."""
        self.handbacks: list[tuple[float, float]] = []
        """(stopped, released) seconds of each hand-back, from its batch's arrival."""
        self.prompts = 0
        """Prompts whose samples the lent rollout stored (all of them, acked next)."""
        self.log_path = os.environ.get(PHASE_LOG)

    @classmethod
    async def of(cls, rt: Runtime, model: Path) -> Lender | None:
        """The trainer's lender when the run lends (`lend: true`), else None. `model`: the
        resolved model path; the engine starts with its memory given back."""
        if not rt.config.lend:
            return None
        cfg = rt.config.rollout
        engines = build_rollout_engines(
            cfg.engine,
            model,
            1,
            seed=rt.config.data.seed,
            dtype=rt.config.model.dtype,
            continuous=True,
        )
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, model)
        lender = cls(rt, Rollout(rt, engines, tokenizer, between_tokens=True))
        await asyncio.to_thread(lender.engine.release_memory)  # the trainer's until it waits
        return lender

    def helpers(self) -> dict[str, Helper]:
        """The lent worker, as a helper of the trainer's stage."""
        return {"lent rollout": self.serve}

    async def serve(self) -> None:
        """The prompts' work queue, fetched only while lending; runs as long as the trainer."""
        slots = self.stepwise.slots
        worker: Worker[PromptEvent] = Worker(
            self.rt.js,
            self.rt.topology,
            PROMPTS,
            self.handle,
            self.rt.publisher,
            WorkerOptions(concurrency=2 * slots, fetch_timeout=FETCH_TIMEOUT),
            self.rollout.dropped,
            fetching=self.fetching,
        )
        await worker.run(asyncio.Event())  # ends when the trainer's stage cancels it

    async def handle(self, prompt: PromptEvent, msg: Msg) -> None:
        """The rollout's handler, counted."""
        await self.rollout.handle(prompt, msg)
        self.prompts += 1

    def offer(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Version `version`, just published by the trainer: loaded at the next lend."""
        self.weights = (tensors, version)

    async def maybe_lend(self, waited: float) -> None:
        """Lend the device if the trainer has waited long enough (`should_lend`)."""
        if should_lend(waited, self.lend_after, self.lending, self.weights is not None):
            await self.lend(waited)

    async def lend(self, waited: float) -> None:
        assert self.weights is not None
        tensors, version = self.weights
        await asyncio.to_thread(self.engine.resume_memory)
        if self.quiet is None:  # the first lend: quiesce, to load
            self.quiet = contextlib.AsyncExitStack()
            await self.quiet.enter_async_context(self.copies.quiesced())
        if self.engine.version < version:
            await self.copies.load(tensors, version)
        await self.quiet.aclose()  # the paused samples go on
        self.quiet = None
        self.copies.open_for_requests.set()
        self.fetching.set()
        self.lending = True
        log.info("lending the trainer's device to rollout (v%d) after %.2f s", version, waited)
        self.record("start", waited=round(waited, 4), version=version)

    async def hand_back(self, arrived: float) -> None:
        """The batch came (`arrived`: its perf_counter time): stop fetching, pause the engine
        between two tokens, give its memory back. Not lending: nothing to do."""
        if not self.lending:
            return
        TRAINER_LENDING(f"{self.prompts} prompts stored so far")
        self.fetching.clear()
        self.quiet = contextlib.AsyncExitStack()
        await self.quiet.enter_async_context(self.copies.quiesced())  # gate closed, paused
        stopped = time.perf_counter() - arrived
        await asyncio.to_thread(self.engine.release_memory)
        released = time.perf_counter() - arrived
        self.lending = False
        self.handbacks.append((stopped, released))
        log.info(
            "device handed back to the trainer: no token computing %.4f s after its batch came, "
            "memory given back after %.4f s",
            stopped,
            released,
        )
        self.record(
            "end", stopped=round(stopped, 4), released=round(released, 4), prompts=self.prompts
        )

    async def close(self) -> None:
        self.fetching.clear()
        if self.quiet is not None:
            await self.quiet.aclose()
            self.quiet = None

    def record(self, event: str, **figures: float | int) -> None:
        if not self.log_path:
            return
        line = {"t": time.time(), "event": event, "phase": "lend", "holder": self.rt.member.key}
        with open(self.log_path, "a") as out:  # one short line: appended whole
            out.write(json.dumps({**line, **figures}) + "\n")
