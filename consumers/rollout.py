"""`python -m consumers.rollout --run R`: prompts in, trajectories out (a group's in one event).

    handler(prompt): tokenize -> the router picks one of the worker's engine copies
        (`rollout.engine_copies`, `rollout.router`; key: `routing_key`) -> that copy's batcher
        generates it with others, or (continuous admission, `rollout.continuous`) each of its
        samples takes an engine slot as one comes free -> publish the prompt's n trajectories
        as one group event (continuous admission: each as it ends, `schemas.group_events`) ->
        return (the loop acks the prompt only once all are stored)
        a prompt it can never generate (untokenizable, too long, failing every delivery):
        recorded as dropped in KV (the gate issues another), then dead-lettered
    batcher, one per copy (`consumers.rollout_copies`): wait for the gate -> up to
        max_batch_prompts of equal sampling -> count it running -> generate in a thread (the
        event loop keeps heartbeating) -> resolve each prompt's future
    weights watcher: each version the weights receiver yields (`consumers.weights.receiver`:
        it follows the weights stream, resolves delta chains, verifies, refuses; generation
        goes on meanwhile) -> close the gate (no new generation starts on any copy), pause
        the engines between two tokens (partial rollout, `rollout.partial`) or drain the
        running generations, load the tensors that changed (`Ready.changed`) into each copy
        in a thread (the event loop keeps heartbeating), resume, tell the receiver, reopen

The copies are `rollout.engine` as `engines.build.build_rollout_engines` makes it, held as
the `RolloutEngine` protocol (a `ContinuousEngine` where samples go one at a time): this stage
names no engine class and never branches on the engine type.

Every token comes from one version: the gate and the pause (or drain) keep a load and a
token's computation from ever running at once. A trajectory's `versions` say which version
computed each token; with partial rollout they may step up mid-sample, never down.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import cast

import numpy as np
import torch
from nats.aio.msg import Msg
from nats.js.errors import KeyWrongLastSequenceError
from opentelemetry import context
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bus import metrics
from bus.crashpoints import ROLLOUT_MID_WEIGHT_LOAD, ROLLOUT_STORED_NOT_ACKED
from bus.runtime import Runtime
from bus.stage import Helper, Stage, run_stage
from bus.topology import PROMPTS, TRAJECTORIES, drop_key
from bus.worker import Reject, WorkerOptions
from consumers.checks import ModelLimits
from consumers.colocation import Phases
from consumers.episode_journal import EpisodeJournal
from consumers.episodes import EpisodeRunner
from consumers.group_publish import send_group
from consumers.rollout_copies import EngineCopies, Pending, stepwise
from consumers.weights.receiver import WeightsReceiver
from engines.build import build_rollout_engines
from engines.environment import EnvironmentLoadError
from engines.model_source import ModelNotFound, resolve_model_path
from engines.protocols import (
    EngineUnavailable,
    ReleasableEngine,
    RolloutEngine,
    Sample,
    WeightsNotLoaded,
)
from engines.router import Router, RouterError, make_router
from engines.tools import ToolError
from engines.weights_group import GroupWeights
from schemas import (
    PromptEvent,
    Tensor,
    TrajectoryEvent,
    TrajectoryGroupEvent,
    group_id,
)
from schemas.kv_records import DropKind, DropRecord, Phase

log = logging.getLogger("jetrl.rollout")
CATCH_UP_SECONDS = 30.0
"""Longest a prompt waits for the weight version it was admitted at (`Rollout.caught_up`):
a load takes seconds even for a large model; past it the worker is stuck on a version, and
generating with it beats generating nothing."""


class Rollout:
    def __init__(
        self,
        rt: Runtime,
        engines: RolloutEngine | Sequence[RolloutEngine],
        tokenizer: PreTrainedTokenizerBase,
        router: Router | None = None,
        between_tokens: bool = False,
    ) -> None:
        """`engines`: the copies (one engine: one copy); `router`: `rollout.router` when None;
        `between_tokens`: continuous admission and partial rollout whatever `rollout.continuous`
        and `rollout.partial` say (a trainer's lent rollout, `consumers.lending`, stops between
        two tokens when its batch comes)."""
        self.rt, self.tokenizer = rt, tokenizer
        engines = list(engines) if isinstance(engines, Sequence) else [engines]
        cfg = rt.config.rollout
        router = router or make_router(cfg.router, len(engines), cfg.router_options)
        self.copies = EngineCopies(
            engines,
            router,
            cfg.max_batch_prompts,
            cfg.engine.type,
            rt.source,
            cfg.continuous or between_tokens,
            cfg.partial or between_tokens,
        )
        self.limits = ModelLimits.of(self.engine.model)
        agent = rt.config.agent
        self.episodes = (
            None
            if agent is None
            else EpisodeRunner(
                agent,
                rt.config.tools,
                tokenizer,
                self.copies,
                self.limits,
                EpisodeJournal(rt.kv, rt.source),
                source=rt.source,
                engine=cfg.engine.type,
            )
        )
        """With `agent` set: each sample of a prompt is an episode (`consumers.episodes`)."""
        self.receiver = WeightsReceiver(
            rt.js,
            rt.topology,
            rt.publisher,
            rt.config.weights,
            self.engine.model,
            member_id=rt.source,
            version=self.engine.version,
            handled=self.open_for_requests,
        )
        """The weight versions to load, verified; it opens the gate once it has handled the
        first (a worker generates only once it knows the run's current version)."""
        engines = self.copies.engines
        if all(isinstance(e, GroupWeights) for e in engines):
            self.receiver.engines = cast(list[GroupWeights], engines)
        self.said_behind = False
        """Whether a prompt generated with older weights than it was admitted at was logged."""

    @property
    def engine(self) -> RolloutEngine:
        """The first copy's engine: all copies serve the same model and version."""
        return self.copies.copies[0].engine

    @property
    def open_for_requests(self) -> asyncio.Event:
        """Open unless weights are loading (`EngineCopies.open_for_requests`)."""
        return self.copies.open_for_requests

    def token_ids(self, prompt: PromptEvent) -> list[int]:
        if prompt.token_ids is not None:
            return prompt.token_ids.numpy().astype(int).tolist()
        if prompt.messages is not None:
            # return_dict=False: transformers 5 returns a BatchEncoding dict when tokenizing
            # otherwise.
            return list(
                self.tokenizer.apply_chat_template(
                    list(prompt.messages),
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            )
        return list(self.tokenizer.encode(prompt.prompt, add_special_tokens=False))

    def checked_token_ids(self, prompt: PromptEvent) -> list[int]:
        """The prompt's token ids, or Reject for a prompt this model can never generate from.

        Checked before the prompt joins a batch: one bad prompt would fail the generation
        of every prompt batched with it, on every retry.
        """
        try:
            ids = self.token_ids(prompt)
        except (
            Exception
        ) as exc:  # tokenizing is deterministic: what fails once fails on every retry
            raise Reject(f"cannot tokenize the prompt: {type(exc).__name__}: {exc}") from None
        if not ids:
            raise Reject("the prompt has no tokens")
        max_tokens = prompt.sampling.max_tokens
        self.limits.check(
            max(ids),
            len(ids) + max_tokens,
            f"prompt of {len(ids)} tokens + max_tokens {max_tokens}",
        )
        return ids

    async def dropped(self, prompt: PromptEvent, reason: str) -> None:
        """Record a prompt that will never be generated (rejected, or failing every delivery) as
        dropped: the gate counts it and issues another in its place. Without the record the gate
        waits for a group that never comes and the run stops short of its last step."""
        with contextlib.suppress(KeyWrongLastSequenceError):  # recorded before a restart
            await self.rt.kv.create(
                drop_key(prompt.id),
                DropRecord(reason=reason, refused=True, kind=DropKind.REFUSED).encode(),
            )

    async def handle(self, prompt: PromptEvent, msg: Msg) -> None:
        await self.caught_up(prompt)
        if self.episodes is not None:
            return await self.handle_episodes(prompt, self.episodes)
        ids = self.checked_token_ids(prompt)
        pending = Pending(
            prompt,
            ids,
            time.perf_counter(),
            asyncio.get_running_loop().create_future(),
            context.get_current(),
        )
        acks, done = [], []
        # Continuous admission: each sample stored as soon as it ends, its own event (a partial
        # group). Batched: the prompt's samples end together, stored as one group event.
        generated = self.copies.samples(pending, routing_key(prompt))
        async with contextlib.aclosing(
            generated
        ):  # a failed send cancels the samples still generating
            async for index, sample, seconds in generated:
                trajectory = self.trajectory(prompt, ids, index, sample, seconds)
                done.append(trajectory)
                if self.copies.continuous:
                    acks.append(await self.rt.publisher.send(TRAJECTORIES, trajectory))
        if not self.copies.continuous:
            acks = await send_group(self.rt.publisher, TRAJECTORIES, self.group(prompt, done))
        await asyncio.gather(*acks)
        ROLLOUT_STORED_NOT_ACKED(prompt.id)
        metrics.count_samples("rollout", "generated", len(done))

    def group(self, prompt: PromptEvent, done: list[TrajectoryEvent]) -> TrajectoryGroupEvent:
        """A prompt's n trajectories, in sample order, as one event."""
        return TrajectoryGroupEvent(
            id=group_id(prompt.id),
            run=prompt.run,
            source=self.rt.source,
            prompt_id=prompt.id,
            samples=tuple(sorted(done, key=lambda t: t.sample_index)),
        )

    async def caught_up(self, prompt: PromptEvent) -> None:
        """Generate a prompt with the weights the gate admitted it at, or newer.

        The producer sees a version as soon as the trainer announces it and admits the next
        step's prompts; this worker loads it a moment later. A prompt generated meanwhile with
        the older weights would be trained a step later than they allow, and dropped as stale:
        at `ops.bench.learn`'s 0.15 s steps that was most of the run's drops (761 of 978
        groups), each replaced and generated again. So a prompt waits for the version, unless
        the worker has handled it and still serves an older one (refused, skipped: there is
        nothing newer to wait for), and for CATCH_UP_SECONDS at most (said once)."""
        if await self.receiver.caught_up(prompt.admitted_version, CATCH_UP_SECONDS):
            return
        if not self.said_behind:
            self.said_behind = True
            log.warning(
                "prompt %s was admitted at weights v%d; serving v%d after %.0f s: generating "
                "it with them (its samples may be dropped as stale)",
                prompt.id,
                prompt.admitted_version,
                self.receiver.version,
                CATCH_UP_SECONDS,
            )

    async def handle_episodes(self, prompt: PromptEvent, episodes: EpisodeRunner) -> None:
        """The prompt's n samples as n episodes, at once; each stored as soon as it ends."""
        acks = []
        running = [asyncio.create_task(episodes.run(prompt, i)) for i in range(prompt.n)]
        try:
            for done in asyncio.as_completed(running):
                trajectory = await done
                acks.append(await self.rt.publisher.send(TRAJECTORIES, trajectory))
        finally:  # one failed (a Reject: the prompt): the others are cancelled with it
            for task in running:
                task.cancel()
        await asyncio.gather(*acks)
        await episodes.journal.forget(prompt.id, prompt.n)  # stored: no episode to resume
        ROLLOUT_STORED_NOT_ACKED(prompt.id)
        metrics.count_samples("rollout", "generated", len(acks))

    def trajectory(
        self, prompt: PromptEvent, ids: list[int], index: int, sample: Sample, seconds: float
    ) -> TrajectoryEvent:
        """Sample `index` of `prompt` as the event stored, its tokens' versions as the engine
        computed them."""
        assert sample.versions is not None  # `EngineCopies.samples` sets them
        return TrajectoryEvent(
            id=f"{prompt.id}/{index}",
            run=prompt.run,
            source=self.rt.source,
            prompt_id=prompt.id,
            sample_index=index,
            group_size=prompt.n,
            prompt_ids=Tensor.from_numpy(np.asarray(ids, np.int32)),
            response_ids=Tensor.from_numpy(sample.token_ids.numpy().astype(np.int32)),
            logprobs=Tensor.from_torch(sample.logprobs.float()),
            versions=Tensor.from_numpy(sample.versions.numpy().astype(np.int32)),
            response_text=self.tokenizer.decode(
                sample.token_ids.tolist(), skip_special_tokens=True
            ),
            finish_reason=sample.finish_reason,
            task=prompt.task,
            engine=self.rt.config.rollout.engine.type,
            timings={"generate": seconds},
        )

    def batchers(self) -> dict[str, Helper]:
        """A batcher per copy, by the name a failure is reported under (none with continuous
        admission: samples go to the engine as they come)."""
        copies = self.copies.copies
        if self.copies.continuous:
            return {}
        if len(copies) == 1:
            return {"batcher": functools.partial(self.copies.batcher, copies[0])}
        return {f"batcher {r.index}": functools.partial(self.copies.batcher, r) for r in copies}

    async def watch_weights(self) -> None:
        """Each version the receiver yields (verified, ready): pause, load the tensors that
        changed, resume, and tell the receiver it is loaded.

        A load that does not read back (`WeightsNotLoaded`) may have left a mix of two versions
        in an engine: the version is loaded again whole, and if that fails too the error ends
        the worker (restarted, it loads the run's last version into a fresh engine): no token
        is computed with weights nobody published."""
        async for ready in self.receiver:
            version = ready.event.version
            # No token is computed inside: paused between two, or drained.
            async with self.copies.quiesced():
                ROLLOUT_MID_WEIGHT_LOAD(f"v{version}")
                # Into every copy, off the event loop.
                if ready.direct:  # by broadcast into the engines; missed: the stored copy
                    fallback = await self.receiver.into_engines(ready)
                    if fallback is not None:
                        await self.copies.load(fallback, version)
                    ready = replace(ready, tensors=fallback or {})
                else:
                    try:
                        await self.copies.load(ready.to_load(), version)
                    except WeightsNotLoaded as exc:
                        log.warning("weights v%d did not load (%s); loading it whole", version, exc)
                        await self.copies.load(ready.tensors, version)
            self.receiver.loaded(ready)
            self.open_for_requests.set()
            self.rt.member.report(weight_version=version)
            log.info(
                "now serving weights v%d (%d of %d tensors loaded%s)",
                version,
                len(ready.changed),
                len(ready.event.manifest),
                "" if not ready.direct else " by broadcast" if not ready.tensors else ", stored",
            )


def routing_key(prompt: PromptEvent) -> str:
    """What `rollout.router` routes a prompt by: its `task.conversation_id` when the producer
    sets one (the turns of one conversation share a prefix, cached by the copy that served
    the last turn), else the prompt id (a redelivered prompt goes back to the same copy)."""
    conversation = prompt.task.get("conversation_id")
    return prompt.id if conversation is None else str(conversation)


async def build(rt: Runtime) -> Stage[PromptEvent]:
    """The rollout stage: prompts served by `Rollout.handle`,
    beside its batcher and weights watcher."""
    cfg = rt.config.rollout
    router = make_router(
        cfg.router, cfg.engine_copies, cfg.router_options
    )  # a bad router fails before a model loads
    # A hub id: fetched or cached; a .gguf file: converted once. In a thread: it can take a while.
    model = await asyncio.to_thread(
        resolve_model_path, rt.config.model.path, rt.config.model.revision
    )
    log.info("model %s loads from %s", rt.config.model.path, model)
    phases = await Phases.of(rt, Phase.ROLLOUT)
    if phases is not None:  # colocated: the engine takes device memory only in our turn
        await phases.enter()
    engines = build_rollout_engines(  # seeded apart: copies do not draw the same samples
        cfg.engine,
        model,
        cfg.engine_copies,
        seed=rt.config.data.seed,
        dtype=rt.config.model.dtype,
        continuous=cfg.continuous,
        releasable=phases is not None,
    )
    rollout = Rollout(rt, engines, AutoTokenizer.from_pretrained(model), router)
    if phases is not None:
        phases.engine = releasable(engines[0])
        await phases.leave()  # its memory given back until its first batch
        rollout.copies.phases = phases
    rt.member.report(engine=cfg.engine.type, weight_version=rollout.engine.version)
    return rollout_stage(rollout)


def rollout_stage(rollout: Rollout) -> Stage[PromptEvent]:
    """`rollout` as a stage: twice a batch of prompts in flight per copy, so one batch fills
    while the copy generates the other (with continuous admission: prompts waiting for a
    slot, so that a slot that comes free is taken at once -- at least twice the engine's slots,
    a prompt holding one sample or more)."""
    config = rollout.rt.config
    per_copy = 2 * config.rollout.max_batch_prompts
    if rollout.copies.continuous:
        per_copy = max(per_copy, 2 * max(stepwise(e).slots for e in rollout.copies.engines))
    concurrency = per_copy * len(rollout.copies.copies)
    tools: dict[str, Helper] = {}
    if rollout.episodes is not None:  # prompts enough for twice the episodes that may run at once
        concurrency = 2 * -(-rollout.episodes.agent.max_episodes // config.data.n)
        tools = {"tool runner": rollout.episodes.serve_tools}
        if rollout.episodes.endpoint is not None:
            tools["agent endpoint"] = rollout.episodes.endpoint.serve
    phases = rollout.copies.phases
    return Stage(
        PROMPTS,
        rollout.handle,
        WorkerOptions(concurrency=concurrency),
        helpers={**rollout.batchers(), "weights watcher": rollout.watch_weights, **tools},
        on_dead=rollout.dropped,
        close=None if phases is None else phases.leave,  # stopped: the device handed back
    )


def releasable(engine: RolloutEngine) -> ReleasableEngine:
    """`engine` as one that gives its device memory back (colocated), or EngineUnavailable."""
    if not isinstance(engine, ReleasableEngine):
        raise EngineUnavailable(
            f"placement colocated: the {type(engine).__name__} cannot release its memory"
        )
    return engine


def main() -> None:
    # One thread: the trainer and the other workers share the node's cores with us.
    torch.set_num_threads(1)
    run_stage(
        "rollout",
        build,
        __doc__.splitlines()[0],
        RouterError,
        EngineUnavailable,
        ModelNotFound,
        EnvironmentLoadError,
        ToolError,
    )


if __name__ == "__main__":
    main()
