"""The rollout worker's engine replicas: a router in front, a batcher per replica, one weights gate.

    submit(pending, key): the router picks a replica from its key and the prompts each has in
        flight -> the prompt joins that replica's queue (counted in flight until generated)
    batcher(replica), one per replica: wait for the gate -> up to max_batch_prompts of equal
        sampling from its queue -> count it running -> generate in a thread (the event loop
        keeps heartbeating) -> resolve each prompt's future
    load(tensors, version): close the gate (no generation starts on any replica), drain the
        running ones on all replicas, copy the one CPU copy of the weights into each replica's
        model in a thread, reopen

Every token of a generation comes from one version: a replica's engine changes weights only
inside `load`, which runs while no generation runs on any replica and none can start.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from opentelemetry import context

from bus import metrics, tracing
from consumers.crashpoints import ROLLOUT_MID_GENERATION
from engines import protocols
from engines.hf_rollout import HFRolloutEngine
from engines.router import Router, RouterError
from engines.sglang_rollout import SGLangRolloutEngine
from engines.simulated import SimulatedRolloutEngine
from engines.vllm_rollout import VLLMRolloutEngine
from schemas import PromptEvent

Engine = HFRolloutEngine | SimulatedRolloutEngine | VLLMRolloutEngine | SGLangRolloutEngine
"""The engines `rollout.engine` names; each holds `model` (real, or a meta-device skeleton) for the checks."""


@dataclass
class Pending:
    prompt: PromptEvent
    token_ids: list[int]
    queued_at: float
    done: asyncio.Future[tuple[list[protocols.Sample], int, float]]
    trace: context.Context
    """The handler's context (inside its process span): the batcher's `generate` span goes there."""


@dataclass
class Replica:
    """One engine and the prompts routed to it."""

    index: int
    engine: Engine
    queue: list[Pending] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while `queue` holds prompts."""
    in_flight: int = 0
    """Prompts routed here and not yet generated (queued or generating): what the router sees."""


class Replicas:
    def __init__(self, engines: Sequence[Engine], router: Router, max_batch_prompts: int, engine_name: str,
                 worker: str) -> None:
        if not engines:
            raise ValueError("a rollout worker needs at least one engine replica")
        self.replicas = [Replica(i, engine) for i, engine in enumerate(engines)]
        self.router, self.max_batch_prompts = router, max_batch_prompts
        self.engine_name, self.worker = engine_name, worker
        # Open (set) unless weights are loading. It starts closed: a worker that joins a
        # running job must not generate with its base model (v0) while the latest version
        # loads — those samples would only be dropped as stale. The first weights event
        # (the trainer publishes v0 at its start) opens it.
        self.gate = asyncio.Event()
        # Generations started and not yet returned, on all replicas; a load waits for `idle`.
        self.running = 0
        self.idle = asyncio.Event()
        self.idle.set()

    @property
    def engines(self) -> list[Engine]:
        return [r.engine for r in self.replicas]

    def route(self, key: str | None) -> Replica:
        in_flight = [r.in_flight for r in self.replicas]
        index = self.router.pick(key, in_flight)
        if not isinstance(index, int) or not 0 <= index < len(self.replicas):
            raise RouterError(f"router {type(self.router).__name__} picked replica {index!r} of {len(self.replicas)}")
        return self.replicas[index]

    async def submit(self, pending: Pending, key: str | None) -> tuple[list[protocols.Sample], int, float]:
        """`pending` generated on the replica the router picks: its samples, version and seconds."""
        replica = self.route(key)
        replica.in_flight += 1
        replica.queue.append(pending)
        replica.wake.set()
        try:
            return await pending.done
        finally:
            replica.in_flight -= 1
            if pending in replica.queue:  # the handler was cancelled before its batch was taken
                replica.queue.remove(pending)

    async def batcher(self, replica: Replica) -> None:
        while True:
            await replica.wake.wait()
            await asyncio.sleep(0.02)  # let a fetch's worth of prompts arrive together
            # Checked again on waking: a load may have closed the gate between the set that
            # woke this task and now. From the check to `running += 1` nothing awaits, so a
            # load that closes the gate after it sees this generation as running.
            while not self.gate.is_set():
                await self.gate.wait()
            if not replica.queue:  # its prompts' handlers were cancelled meanwhile
                replica.wake.clear()
                continue
            first = replica.queue[0]
            same = [p for p in replica.queue if (p.prompt.n, p.prompt.sampling) == (first.prompt.n, first.prompt.sampling)]
            batch = same[: self.max_batch_prompts]
            replica.queue = [p for p in replica.queue if p not in batch]
            if not replica.queue:
                replica.wake.clear()
            self.running += 1
            self.idle.clear()
            try:
                await self.generate(replica, batch)
            finally:
                self.running -= 1
                if not self.running:
                    self.idle.set()

    async def generate(self, replica: Replica, batch: list[Pending]) -> None:
        """Generate `batch` on `replica` in a thread; resolve each prompt's future."""
        first, engine = batch[0], replica.engine
        s = first.prompt.sampling
        params = protocols.SamplingParams(s.temperature, s.top_p, s.max_tokens, s.stop_token_ids)
        version, started = engine.version, time.perf_counter()
        try:
            parents = [(p.trace, self.span_attributes(p, version, len(batch), replica.index)) for p in batch]
            with tracing.spans_in("generate", parents) as spans:
                ROLLOUT_MID_GENERATION(f"{len(batch)} prompts from {first.prompt.id}")
                groups = await asyncio.to_thread(engine.generate, [p.token_ids for p in batch], first.prompt.n, params)
                for span, samples in zip(spans, groups):
                    span.set_attribute("jetrl.tokens", sum(len(s.token_ids) for s in samples))
        except Exception as exc:  # the prompts' handlers fail and are retried
            for p in batch:
                if not p.done.done():
                    p.done.set_exception(exc)
            return
        seconds = time.perf_counter() - started
        metrics.GENERATE_SECONDS.record(seconds, {"engine": self.engine_name})
        for p, samples in zip(batch, groups):
            if not p.done.done():
                p.done.set_result((samples, version, seconds))

    def span_attributes(self, pending: Pending, version: int, batch_prompts: int, replica: int) -> dict[str, str | int]:
        """What a prompt's `generate` span says: which prompt, weights, engine, worker, replica, batch."""
        return {
            "jetrl.prompt_id": pending.prompt.id, "jetrl.policy_version": version, "jetrl.engine": self.engine_name,
            "jetrl.worker": self.worker, "jetrl.replica": replica, "jetrl.samples": pending.prompt.n,
            "jetrl.prompt_tokens": len(pending.token_ids), "jetrl.batch_prompts": batch_prompts,
        }

    async def close_and_drain(self) -> None:
        """Close the gate (no generation starts on any replica) and wait until none runs."""
        self.gate.clear()
        while self.running:
            await self.idle.wait()

    async def load(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy `tensors` into every replica's model; the gate must be closed and drained.

        One replica after another, each in a thread (a large model takes seconds, and the
        event loop must keep heartbeating the prompts it holds); the tensors are the one CPU
        copy, read by each `load_state_dict`."""
        assert not self.gate.is_set() and not self.running, "a load while generation may run"
        for replica in self.replicas:
            await asyncio.to_thread(replica.engine.load_state_dict, tensors, version=version)
