"""The rollout worker's engine copies: a router in front, a batcher per copy, one weights gate.

    submit(pending, key): the router picks a copy from its key and the prompts each has in
        flight -> the prompt joins that copy's queue (counted in flight until generated)
    batcher(copy), one per copy: wait for the gate -> up to max_batch_prompts of equal
        sampling from its queue -> count it running -> generate in a thread (the event loop
        keeps heartbeating) -> resolve each prompt's future
    samples(pending, key), continuous admission (`rollout.continuous`, engines that are a
        `ContinuousEngine`: the simulated one): no batcher; each of the prompt's n samples
        takes one of the copy's `slots` as one comes free -> `generate_sample` in the
        copy's own threads -> each sample is handed back as soon as it ends
    quiesced(): close the gate (no generation starts on any copy), then
        partial rollout (`rollout.partial`, continuous engines): pause every copy's engine
            between two tokens; the samples in flight go on with the new weights after `load`
        otherwise: drain the running generations on all copies
    load(tensors, version): the one CPU copy of the weights into each engine copy's model, in
        a thread (inside `quiesced`, which then resumes and the caller reopens the gate)

Every token comes from one version: a copy's engine changes weights only inside
`quiesced`, while no token is computed on any copy and none can start. Without partial
rollout every generation comes from one version too; with it, a sample's tokens record the
versions that computed them (`Sample.versions`), which never go backwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import cast

import torch
from opentelemetry import context

from bus import metrics, tracing
from bus.crashpoints import ROLLOUT_MID_GENERATION
from consumers.colocation import Phases
from engines import protocols
from engines.protocols import ContinuousEngine, RolloutEngine
from engines.router import Router, RouterError
from schemas import PromptEvent


@dataclass
class Pending:
    prompt: PromptEvent
    token_ids: list[int]
    queued_at: float
    done: asyncio.Future[tuple[list[protocols.Sample], int, float]]
    trace: context.Context
    """The handler's context (inside its process span): the batcher's `generate` span goes there."""


@dataclass
class EngineCopy:
    """One engine and the prompts routed to it."""

    index: int
    engine: RolloutEngine
    queue: list[Pending] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while `queue` holds prompts."""
    in_flight: int = 0
    """Prompts routed here and not yet generated (queued or generating): what the router sees."""
    slots: asyncio.Semaphore | None = None
    """Continuous admission: the engine's free slots (one per sample generating)."""
    threads: ThreadPoolExecutor | None = None
    """Continuous admission: one thread per slot, each running one `generate_sample`."""


class EngineCopies:
    def __init__(
        self,
        engines: Sequence[RolloutEngine],
        router: Router,
        max_batch_prompts: int,
        engine_name: str,
        worker: str,
        continuous: bool = False,
        partial: bool = False,
    ) -> None:
        """`continuous`, `partial`: `rollout.continuous` and `rollout.partial`, taken only where
        every engine is a `ContinuousEngine` (the others are given batches and drained)."""
        if not engines:
            raise ValueError("a rollout worker needs at least one engine copy")
        self.copies = [EngineCopy(i, engine) for i, engine in enumerate(engines)]
        self.continuous = continuous and all(isinstance(e, ContinuousEngine) for e in engines)
        self.partial = partial and self.continuous
        for r in self.copies if self.continuous else ():
            slots = stepwise(r.engine).slots
            r.slots = asyncio.Semaphore(slots)
            r.threads = ThreadPoolExecutor(slots, thread_name_prefix=f"rollout-copy-{r.index}")
        self.router, self.max_batch_prompts = router, max_batch_prompts
        self.engine_name, self.worker = engine_name, worker
        # Open (set) unless weights are loading. It starts closed: a worker that joins a
        # running job must not generate with its base model (v0) while the latest version
        # loads — those samples would only be dropped as stale. The first weights event
        # (the trainer publishes v0 at its start) opens it.
        self.open_for_requests = asyncio.Event()
        # Generations started and not yet returned, on all copies; a load waits for `idle`.
        self.running = 0
        self.idle = asyncio.Event()
        self.phases: Phases | None = None
        """`placement: colocated`: the turns on the node's device each batch is generated in
        (`consumers.colocation`; batch admission only, which the config requires)."""
        self.idle.set()
        self.quiet = False
        """True inside `quiesced`: no token is being computed on any copy."""

    @property
    def engines(self) -> list[RolloutEngine]:
        return [r.engine for r in self.copies]

    def route(self, key: str | None) -> EngineCopy:
        in_flight = [r.in_flight for r in self.copies]
        index = self.router.pick(key, in_flight)
        if not isinstance(index, int) or not 0 <= index < len(self.copies):
            raise RouterError(
                f"router {type(self.router).__name__} picked copy {index!r} of {len(self.copies)}"
            )
        return self.copies[index]

    async def submit(
        self, pending: Pending, key: str | None
    ) -> tuple[list[protocols.Sample], int, float]:
        """`pending` generated on the copy the router picks: its samples, version and seconds."""
        copy = self.route(key)
        copy.in_flight += 1
        copy.queue.append(pending)
        copy.wake.set()
        try:
            return await pending.done
        finally:
            copy.in_flight -= 1
            if pending in copy.queue:  # the handler was cancelled before its batch was taken
                copy.queue.remove(pending)

    async def batcher(self, copy: EngineCopy) -> None:
        while True:
            await copy.wake.wait()
            await asyncio.sleep(0.005)  # let a fetch's worth of prompts arrive together
            # Checked again on waking: a load may have closed the gate between the set that
            # woke this task and now. From the check to `running += 1` nothing awaits, so a
            # load that closes the gate after it sees this generation as running.
            while not self.open_for_requests.is_set():
                await self.open_for_requests.wait()
            if not copy.queue:  # its prompts' handlers were cancelled meanwhile
                copy.wake.clear()
                continue
            first = copy.queue[0]
            same = [
                p
                for p in copy.queue
                if (p.prompt.n, p.prompt.sampling) == (first.prompt.n, first.prompt.sampling)
            ]
            batch = same[: self.max_batch_prompts]
            copy.queue = [p for p in copy.queue if p not in batch]
            if not copy.queue:
                copy.wake.clear()
            self.running += 1
            self.idle.clear()
            try:
                if self.phases is not None:  # colocated: the device is ours for this batch
                    await self.phases.enter()
                await self.generate(copy, batch)
            finally:
                self.running -= 1
                if not self.running:
                    self.idle.set()
            if self.phases is not None:  # nothing more now, or the trainer waits: hand it over
                await self.phases.boundary(more=lambda: bool(copy.queue))

    async def generate(self, copy: EngineCopy, batch: list[Pending]) -> None:
        """Generate `batch` on `copy` in a thread; resolve each prompt's future."""
        first, engine = batch[0], copy.engine
        s = first.prompt.sampling
        params = protocols.SamplingParams(s.temperature, s.top_p, s.max_tokens, s.stop_token_ids)
        version, started = engine.version, time.perf_counter()
        try:
            parents = [
                (p.trace, self.span_attributes(p, version, len(batch), copy.index)) for p in batch
            ]
            with tracing.spans_in("generate", parents) as spans:
                ROLLOUT_MID_GENERATION(f"{len(batch)} prompts from {first.prompt.id}")
                groups = await asyncio.to_thread(
                    engine.generate, [p.token_ids for p in batch], first.prompt.n, params
                )
                for span, samples in zip(spans, groups, strict=True):
                    span.set_attribute("jetrl.tokens", sum(len(s.token_ids) for s in samples))
        except Exception as exc:  # the prompts' handlers fail and are retried
            for p in batch:
                if not p.done.done():
                    p.done.set_exception(exc)
            return
        seconds = time.perf_counter() - started
        metrics.GENERATE_SECONDS.record(seconds, {"engine": self.engine_name})
        for p, samples in zip(batch, groups, strict=True):
            if not p.done.done():
                p.done.set_result((samples, version, seconds))

    def span_attributes(
        self, pending: Pending, version: int, batch_prompts: int, copy: int
    ) -> dict[str, str | int]:
        """What a prompt's `generate` span says: which prompt, weights, engine, worker,
        copy, batch."""
        return {
            "jetrl.prompt_id": pending.prompt.id,
            "jetrl.policy_version": version,
            "jetrl.engine": self.engine_name,
            "jetrl.worker": self.worker,
            "jetrl.engine_copy": copy,
            "jetrl.samples": pending.prompt.n,
            "jetrl.prompt_tokens": len(pending.token_ids),
            "jetrl.batch_prompts": batch_prompts,
        }

    @contextlib.asynccontextmanager
    async def quiesced(self) -> AsyncIterator[None]:
        """While inside, no token is computed on any copy: the gate is closed (no generation
        starts) and either every engine is paused between tokens (partial rollout) or the
        running generations have drained. The engines resume on the way out; the caller
        reopens the gate."""
        self.open_for_requests.clear()
        if not self.partial:
            while self.running:
                await self.idle.wait()
            self.quiet = True
            try:
                yield
            finally:
                self.quiet = False
            return
        paused: list[ContinuousEngine] = []
        try:
            # A pause waits for the tokens being computed: in a thread.
            for engine in map(stepwise, self.engines):
                paused.append(engine)
                await asyncio.to_thread(engine.pause)
            self.quiet = True
            yield
        finally:
            self.quiet = False
            for engine in paused:
                engine.resume()

    async def load(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy `tensors` into every copy's model; only inside `quiesced`.

        One copy after another, each in a thread (a large model takes seconds, and the
        event loop must keep heartbeating the prompts it holds); the tensors are the one CPU
        copy, read by each `load_state_dict`."""
        assert self.quiet and not self.open_for_requests.is_set(), "a load while generation may run"
        for copy in self.copies:
            await asyncio.to_thread(copy.engine.load_state_dict, tensors, version=version)

    async def samples(
        self, pending: Pending, key: str | None
    ) -> AsyncGenerator[tuple[int, protocols.Sample, float]]:
        """`pending`'s samples as each ends, on the copy the router picks: (index, sample,
        seconds it generated). Batch engines: all at once, when their batch returns."""
        if not self.continuous:
            samples, version, seconds = await self.submit(pending, key)
            for index, sample in enumerate(
                samples
            ):  # every token from the version the batch ran with
                yield (
                    index,
                    dataclasses.replace(
                        sample,
                        versions=torch.full((len(sample.token_ids),), version, dtype=torch.int32),
                    ),
                    seconds,
                )
            return
        copy = self.route(key)
        copy.in_flight += 1
        tasks = [
            asyncio.create_task(self.generate_one(copy, pending, i))
            for i in range(pending.prompt.n)
        ]
        try:
            for done in asyncio.as_completed(tasks):
                yield await done
        finally:  # a handler cancelled (or failed) leaves no sample behind it waiting for a slot
            copy.in_flight -= 1
            for task in tasks:
                task.cancel()

    async def generate_one(
        self, copy: EngineCopy, pending: Pending, index: int
    ) -> tuple[int, protocols.Sample, float]:
        """Sample `index` of `pending` on one of `copy`'s slots, in one of its threads."""
        assert copy.slots is not None and copy.threads is not None
        engine = stepwise(copy.engine)
        s = pending.prompt.sampling
        params = protocols.SamplingParams(s.temperature, s.top_p, s.max_tokens, s.stop_token_ids)
        await copy.slots.acquire()
        job: Future[tuple[protocols.Sample, float]] | None = None
        try:
            # From the gate's check to `running += 1` nothing awaits: a load that closes the
            # gate after the check sees this sample as running (drained, or paused mid-way).
            while not self.open_for_requests.is_set():
                await self.open_for_requests.wait()
            attributes = self.span_attributes(pending, engine.version, 1, copy.index)
            with tracing.spans_in("generate", [(pending.trace, attributes)]) as spans:
                ROLLOUT_MID_GENERATION(f"sample {index} of {pending.prompt.id}")
                job = copy.threads.submit(timed, engine.generate_sample, pending.token_ids, params)
                self.started(job, copy.slots)
                sample, seconds = await asyncio.wrap_future(job)
                spans[0].set_attribute("jetrl.tokens", len(sample.token_ids))
        except BaseException:
            if (
                job is None
            ):  # the slot was never handed to a thread (which gives it back when it ends)
                copy.slots.release()
            raise
        metrics.GENERATE_SECONDS.record(seconds, {"engine": self.engine_name})
        return index, sample, seconds

    def started(self, job: Future[tuple[protocols.Sample, float]], slot: asyncio.Semaphore) -> None:
        """Count `job` running until its thread ends (or it is cancelled before it starts): a
        cancelled handler does not stop a thread, and a drain must wait for it."""
        loop = asyncio.get_running_loop()
        self.running += 1
        self.idle.clear()

        def ended() -> None:
            slot.release()
            self.running -= 1
            if not self.running:
                self.idle.set()

        def done(_: Future[tuple[protocols.Sample, float]]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed first: the stage has ended
                loop.call_soon_threadsafe(ended)

        job.add_done_callback(done)


def stepwise(engine: RolloutEngine) -> ContinuousEngine:
    """`engine` as the `ContinuousEngine` it is with continuous admission (`EngineCopies.continuous`
    is set only when every engine is one)."""
    return cast(ContinuousEngine, engine)


def timed(
    generate: Callable[[Sequence[int], protocols.SamplingParams], protocols.Sample],
    prompt: Sequence[int],
    params: protocols.SamplingParams,
) -> tuple[protocols.Sample, float]:
    """`generate(prompt, params)` and the seconds it took, measured in its own thread (not the
    time it waited for one)."""
    started = time.perf_counter()
    sample = generate(prompt, params)
    return sample, time.perf_counter() - started
