"""`python -m consumers.rollout --run R`: prompts in, one trajectory per sample out.

    handler(prompt): queue it -> the batcher generates it with others -> publish its n
        trajectories -> return (the loop acks the prompt only once all are stored)
        a prompt it can never generate (untokenizable, too long, failing every delivery):
        recorded as dropped in KV (the gate issues another), then dead-lettered
    batcher: wait for the gate -> up to max_batch_prompts of equal sampling -> count it
        running -> generate in a thread (the event loop keeps heartbeating) -> resolve
        each prompt's future
    weights watcher: new WeightVersionEvent -> check its manifest against the model,
        fetch + verify bytes with the transport the event names (`consumers.weights`;
        a delta is applied onto the worker's CPU copy of its version, `consumers.weights.chain`;
        generation goes on meanwhile) -> close the gate (no new generation starts), drain
        the running ones, load in a thread (the event loop keeps heartbeating), reopen; a
        version that fails is dead-lettered, never loaded (one whose bytes were pruned
        because newer versions came is skipped)

Every token of a generation comes from one version: the gate and the drain keep a load
and a generation from ever running at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import nats.errors
import nats.js.errors
import numpy as np
import torch
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy
from nats.js.errors import KeyWrongLastSequenceError
from opentelemetry import context
from transformers import AutoTokenizer

from bus import metrics, tracing
from bus.dead import dead_letter
from bus.topology import PROMPTS, REFUSED_PROMPT, TRAJECTORIES, WEIGHTS, drop_key
from bus.worker import Reject, WorkerOptions
from consumers.checks import ModelLimits
from consumers.crashpoints import (
    ROLLOUT_MID_GENERATION,
    ROLLOUT_MID_WEIGHT_LOAD,
    ROLLOUT_STORED_NOT_ACKED,
)
from consumers.runtime import Runtime
from consumers.stage import Stage, run_stage
from consumers.weights import (
    WeightsMissing,
    WeightsUnavailable,
    WeightTransport,
    transport_for,
)
from consumers.weights.chain import Follower
from engines import protocols
from engines.external_rollout import EngineUnavailable
from engines.hf_rollout import HFRolloutEngine
from engines.sglang_rollout import SGLangRolloutEngine, SGLangSettings
from engines.simulated import SimulatedRolloutEngine, SimulatedSettings
from engines.vllm_rollout import VLLMRolloutEngine, VLLMSettings
from engines.weights import WeightsRefused, check_manifest
from schemas import (
    DecodeError,
    PromptEvent,
    Tensor,
    TrajectoryEvent,
    WeightVersionEvent,
    decode,
)
from schemas.config import RunConfig

log = logging.getLogger("jetrl.rollout")

ServingEngine = HFRolloutEngine | SimulatedRolloutEngine | VLLMRolloutEngine | SGLangRolloutEngine
"""The engines `rollout.engine` names; each holds `model` (real, or a meta-device skeleton) for the checks."""


@dataclass
class Pending:
    prompt: PromptEvent
    token_ids: list[int]
    queued_at: float
    done: asyncio.Future[tuple[list[protocols.Sample], int, float]]
    trace: context.Context
    """The handler's context (inside its process span): the batcher's `generate` span goes there."""


class Rollout:
    def __init__(self, rt: Runtime, engine: ServingEngine, tokenizer: object) -> None:
        self.rt, self.engine, self.tokenizer = rt, engine, tokenizer
        self.limits = ModelLimits.of(engine.model)
        self.queue: list[Pending] = []
        self.wake = asyncio.Event()
        # Open (set) unless weights are loading. It starts closed: a worker that joins a
        # running job must not generate with its base model (v0) while the latest version
        # loads — those samples would only be dropped as stale. The first weights event
        # (the trainer publishes v0 at its start) opens it.
        self.gate = asyncio.Event()
        # Generations started and not yet returned; a load waits for `idle` (none running).
        self.running = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.transports: dict[str, WeightTransport] = {}
        """By name, made when an event first names one: the event says where its bytes are."""
        self.chain = Follower()
        """The CPU copy of the version served, which deltas apply onto (`weights.delta`)."""

    def token_ids(self, prompt: PromptEvent) -> list[int]:
        if prompt.token_ids is not None:
            return prompt.token_ids.numpy().astype(int).tolist()
        if prompt.messages is not None:
            return list(self.tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True))
        return list(self.tokenizer.encode(prompt.prompt, add_special_tokens=False))

    def checked_token_ids(self, prompt: PromptEvent) -> list[int]:
        """The prompt's token ids, or Reject for a prompt this model can never generate from.

        Checked before the prompt joins a batch: one bad prompt would fail the generation
        of every prompt batched with it, on every retry.
        """
        try:
            ids = self.token_ids(prompt)
        except Exception as exc:  # tokenizing is deterministic: what fails once fails on every retry
            raise Reject(f"cannot tokenize the prompt: {type(exc).__name__}: {exc}") from None
        if not ids:
            raise Reject("the prompt has no tokens")
        max_tokens = prompt.sampling.max_tokens
        self.limits.check(max(ids), len(ids) + max_tokens, f"prompt of {len(ids)} tokens + max_tokens {max_tokens}")
        return ids

    async def dropped(self, prompt: PromptEvent, reason: str) -> None:
        """Record a prompt that will never be generated (rejected, or failing every delivery) as
        dropped: the gate counts it and issues another in its place. Without the record the gate
        waits for a group that never comes and the run stops short of its last step."""
        with contextlib.suppress(KeyWrongLastSequenceError):  # recorded before a restart
            await self.rt.kv.create(drop_key(prompt.id), f"{REFUSED_PROMPT}{reason}".encode())

    async def handle(self, prompt: PromptEvent, msg: Msg) -> None:
        ids = self.checked_token_ids(prompt)
        pending = Pending(
            prompt, ids, time.perf_counter(), asyncio.get_running_loop().create_future(), context.get_current()
        )
        self.queue.append(pending)
        self.wake.set()
        samples, version, seconds = await pending.done
        texts = self.tokenizer.batch_decode([s.token_ids.tolist() for s in samples], skip_special_tokens=True)
        acks = []
        for index, (sample, text) in enumerate(zip(samples, texts)):
            response = sample.token_ids.numpy().astype(np.int32)
            trajectory = TrajectoryEvent(
                id=f"{prompt.id}/{index}", run=prompt.run, source=self.rt.source, prompt_id=prompt.id,
                sample_index=index, group_size=prompt.n, prompt_ids=Tensor.from_numpy(np.asarray(ids, np.int32)),
                response_ids=Tensor.from_numpy(response), logprobs=Tensor.from_torch(sample.logprobs.float()),
                versions=Tensor.from_numpy(np.full(len(response), version, np.int32)),
                response_text=text,
                finish_reason=sample.finish_reason, task=prompt.task, engine=self.rt.config.rollout.engine,
                timings={"generate": seconds},
            )
            acks.append(await self.rt.publisher.send(TRAJECTORIES, trajectory))
        await asyncio.gather(*acks)
        ROLLOUT_STORED_NOT_ACKED(prompt.id)
        metrics.count_samples("rollout", "generated", len(samples))

    async def batcher(self) -> None:
        limit = self.rt.config.rollout.max_batch_prompts
        while True:
            await self.wake.wait()
            await asyncio.sleep(0.02)  # let a fetch's worth of prompts arrive together
            # Checked again on waking: a load may have closed the gate between the set that
            # woke this task and now. From the check to `running += 1` nothing awaits, so a
            # load that closes the gate after it sees this generation as running.
            while not self.gate.is_set():
                await self.gate.wait()
            first = self.queue[0]
            batch = [p for p in self.queue if (p.prompt.n, p.prompt.sampling) == (first.prompt.n, first.prompt.sampling)]
            batch = batch[:limit]
            self.queue = [p for p in self.queue if p not in batch]
            if not self.queue:
                self.wake.clear()
            s = first.prompt.sampling
            params = protocols.SamplingParams(s.temperature, s.top_p, s.max_tokens, s.stop_token_ids)
            self.running += 1
            self.idle.clear()
            version, started = self.engine.version, time.perf_counter()
            try:
                parents = [(p.trace, self.span_attributes(p, version, len(batch))) for p in batch]
                with tracing.spans_in("generate", parents) as spans:
                    ROLLOUT_MID_GENERATION(f"{len(batch)} prompts from {first.prompt.id}")
                    groups = await asyncio.to_thread(
                        self.engine.generate, [p.token_ids for p in batch], first.prompt.n, params
                    )
                    for span, samples in zip(spans, groups):
                        span.set_attribute("jetrl.tokens", sum(len(s.token_ids) for s in samples))
            except Exception as exc:  # the prompts' handlers fail and are retried
                for p in batch:
                    p.done.set_exception(exc)
                continue
            finally:
                self.running -= 1
                if not self.running:
                    self.idle.set()
            seconds = time.perf_counter() - started
            metrics.GENERATE_SECONDS.record(seconds, {"engine": self.rt.config.rollout.engine})
            for p, samples in zip(batch, groups):
                p.done.set_result((samples, version, seconds))

    def span_attributes(self, pending: Pending, version: int, batch_prompts: int) -> dict[str, str | int]:
        """What a prompt's `generate` span says: which prompt, weights, engine, worker, batch."""
        return {
            "jetrl.prompt_id": pending.prompt.id, "jetrl.policy_version": version, "jetrl.engine": self.rt.config.rollout.engine,
            "jetrl.worker": self.rt.source, "jetrl.samples": pending.prompt.n,
            "jetrl.prompt_tokens": len(pending.token_ids), "jetrl.batch_prompts": batch_prompts,
        }

    async def watch_weights(self) -> None:
        sub = await self.rt.js.subscribe(
            self.rt.topology.subject(WEIGHTS), ordered_consumer=True, deliver_policy=DeliverPolicy.LAST
        )
        async for msg in sub.messages:
            try:
                event = decode(msg.data, WeightVersionEvent)
                await self.load_weights(event, msg.metadata.sequence.stream)
            except WeightsMissing as exc:  # pruned: gone only once newer versions were stored
                newer = await self.superseded(event)
                if newer is None:
                    log.warning("weights not loaded, still serving v%d: %s", self.engine.version, exc)
                elif newer:
                    log.info("weights v%d skipped, a newer version is announced: %s", event.version, exc)
                else:
                    await self.refuse(msg, exc)
            except (DecodeError, WeightsRefused) as exc:  # reported, never loaded
                await self.refuse(msg, exc)
            except (nats.errors.Error, WeightsUnavailable) as exc:  # not fetched now; a later version will be
                log.warning("weights not loaded, still serving v%d: %s", self.engine.version, exc)
            self.gate.set()  # after the first event, whatever came of it

    async def refuse(self, msg: Msg, exc: Exception) -> None:
        log.error("weights refused, still serving v%d: %s", self.engine.version, exc)
        await dead_letter(self.rt.publisher, "rollout", msg, f"weights refused: {exc}")

    async def superseded(self, event: WeightVersionEvent) -> bool | None:
        """Whether a version newer than `event`'s is announced (the last on `weights`); None
        when the server cannot say now."""
        try:
            last = await self.rt.js.get_last_msg(self.rt.topology.stream(WEIGHTS), self.rt.topology.subject(WEIGHTS))
        except nats.errors.Error:
            return None
        try:
            return decode(last.data or b"", WeightVersionEvent).version > event.version
        except DecodeError:
            return False

    def transport(self, event: WeightVersionEvent) -> WeightTransport:
        if event.transport not in self.transports:
            topology = self.rt.topology
            self.transports[event.transport] = transport_for(
                self.rt.config.weights, self.rt.js, topology.object_bucket, topology.run, event.transport,
                member_id=self.rt.source,
            )
        return self.transports[event.transport]

    async def earlier(self, seq: int, versions: set[int], full: int) -> dict[int, WeightVersionEvent]:
        """The events of `versions` on the chain from full version `full`, looked up backwards
        on the `weights` stream from sequence `seq` (the event being loaded): the nearest one of
        each version, since a trainer resumed from a checkpoint publishes a version again. The
        walk ends at the chain's full version (at most `full_every` versions back)."""
        found: dict[int, WeightVersionEvent] = {}
        stream = self.rt.topology.stream(WEIGHTS)
        while seq > 1 and not versions <= set(found):
            seq -= 1
            try:
                raw = await self.rt.js.get_msg(stream, seq)
                event = decode(raw.data or b"", WeightVersionEvent)
            except nats.js.errors.NotFoundError:
                break  # aged out of the stream: older ones are too
            except DecodeError:
                continue
            if event.version in versions and event.full_version == full and event.version not in found:
                found[event.version] = event
            if event.version == full and event.base_version is None:
                break
        return found

    async def load_weights(self, event: WeightVersionEvent, seq: int = 0) -> None:
        """Serve `event`'s weights if they are newer; WeightsRefused if they do not fit the model.

        The bytes are fetched and verified while generation goes on (a delta is applied onto
        the worker's CPU copy then too; `seq`: the event's stream sequence, from which the
        events of its chain are looked up); only then is the gate closed, the running
        generations drained and the tensors copied in. A fetch that fails leaves the model as
        it was."""
        if event.version <= self.engine.version:
            return
        check_manifest(event.manifest, self.engine.model)  # before a byte is fetched
        tensors = await self.chain.fetch(
            event, self.transport, lambda versions, full: self.earlier(seq, versions, full)
        )
        self.gate.clear()  # no new generation starts ...
        while self.running:  # ... and the running ones finish first
            await self.idle.wait()
        ROLLOUT_MID_WEIGHT_LOAD(f"v{event.version}")
        # In a thread: a large model takes seconds to load, and the event loop must keep
        # heartbeating the prompts it holds meanwhile.
        await asyncio.to_thread(self.engine.load_state_dict, tensors, version=event.version)
        self.gate.set()
        self.rt.member.report(weight_version=event.version)
        log.info("now serving weights v%d", event.version)


def make_engine(cfg: RunConfig, model: Path) -> ServingEngine:
    """The engine `rollout.engine` names; the simulated one keeps the real model for its checks only.

    vllm and sglang are imported by their engine's constructor only: without their extra
    installed, a one-line `EngineUnavailable` names the pip command.
    """
    engine = cfg.rollout.engine
    if engine == "vllm":
        return VLLMRolloutEngine(model, VLLMSettings(**cfg.rollout.vllm.model_dump(), seed=cfg.data.seed))
    if engine == "sglang":
        return SGLangRolloutEngine(model, SGLangSettings(**cfg.rollout.sglang.model_dump(), seed=cfg.data.seed))
    hf = HFRolloutEngine(model, seed=cfg.data.seed)
    if engine == "hf":
        return hf
    sim = cfg.rollout.simulated
    settings = SimulatedSettings(sim.median_tokens, sim.sigma, sim.seconds_per_token, sim.slots, cfg.data.seed)
    vocab = ModelLimits.of(hf.model).vocab_size
    return SimulatedRolloutEngine(hf.model, vocab, hf.eos_token_ids[0], settings)


async def build(rt: Runtime) -> Stage[PromptEvent]:
    """The rollout stage: prompts served by `Rollout.handle`, beside its batcher and weights watcher."""
    model = Path(rt.config.model.path or "")
    rollout = Rollout(rt, make_engine(rt.config, model), AutoTokenizer.from_pretrained(model))
    rt.member.report(engine=rt.config.rollout.engine, weight_version=rollout.engine.version)
    return rollout_stage(rollout)


def rollout_stage(rollout: Rollout) -> Stage[PromptEvent]:
    """`rollout` as a stage: twice a batch of prompts in flight, so one batch fills while the
    engine generates the other."""
    return Stage(
        PROMPTS, rollout.handle, WorkerOptions(concurrency=2 * rollout.rt.config.rollout.max_batch_prompts),
        helpers={"batcher": rollout.batcher, "weights watcher": rollout.watch_weights},
        on_dead=rollout.dropped,
    )


def main() -> None:
    # One thread: the trainer and the other workers share the node's cores with us.
    torch.set_num_threads(1)
    run_stage("rollout", build, __doc__.splitlines()[0], EngineUnavailable)


if __name__ == "__main__":
    main()
