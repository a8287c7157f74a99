"""Continuous admission and partial rollout in the rollout worker, on a real nats-server.

The worker runs in this event loop as `consumers.rollout.build` builds it, on the simulated
engine (which takes samples one at a time and pauses between tokens), recording when each
token was computed and when each load ran (a load made slow, as a large model's is). Weight
versions are published while prompts keep flowing:

- no token is computed while weights load, and each token is computed with one version;
- samples in flight when a version comes go on with it (partial rollout): their per-token
  versions step up at one point and never go back;
- each sample is stored as soon as it ends, not when the slowest of its group does.

The staleness bound judged by a sample's oldest token is checked in the buffer process
(`test_a_group_whose_first_tokens_are_too_old_is_dropped_though_its_last_are_new`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from nats.js import JetStreamContext

from bus.embedded import EmbeddedNats
from bus.topology import PROMPTS, TRAJECTORIES, WEIGHTS, Topology
from consumers.checks import ModelLimits
from engines.hf_rollout import HFRolloutEngine
from engines.simulated import SimulatedRolloutEngine, SimulatedSettings
from schemas import PromptEvent, RewardEvent, Tensor, TrajectoryEvent, encode
from schemas import SamplingParams as PromptSampling
from schemas.config import AlgorithmConfig, RunConfig, TrainerConfig
from tests.buffer_feed import (
    SETTLE,
    batches,
    by_step,
    declare,
    drained,
    drop_record,
    group,
    publish,
    run_with_js,
    start_buffer,
    stop_buffer,
    summary,
    tail,
    until,
)
from tests.helpers import store_weights, stream_samples
from tests.test_rollout_invariants import served_rollout

GROUP = 2
TOKENS = 30
"""Every sample's length (sigma 0): 30 tokens of 10 ms, about 0.3 s."""
SECONDS_PER_TOKEN = 0.01
LOAD_SECONDS = 0.3
LOADS = 2
HOLD_SECONDS = 10.0
"""How long a held sample waits for the load it is held for (see `RecordingSimulated.hold`)."""


@dataclass(frozen=True)
class Span:
    """A token's computation or a load, as it ran (monotonic clock), and the versions around it."""

    kind: str
    start: float
    end: float
    version_at_start: int
    version_at_end: int


class RecordingSimulated(SimulatedRolloutEngine):
    """The simulated engine, recording every token computed and every load; a load takes
    LOAD_SECONDS and, unlike the engine's own, does not refuse to run beside a token (so that
    the worker's pause, not the engine's guard, is what is checked).

    `hold()` makes every sample wait before its next token until a load starts (at most
    HOLD_SECONDS), so the samples in flight are still in flight when the version arrives,
    however long its fetch takes on a loaded machine. The held tokens are not yet computing,
    so the worker's pause goes through; they go on as the load starts and meet the pause, not
    the hold, while it runs: a worker that does not pause still computes them beside the load."""

    def __init__(self, model_dir: Path) -> None:
        hf = HFRolloutEngine(model_dir, seed=0)  # the real model, for the worker's checks only
        settings = SimulatedSettings(
            median_tokens=TOKENS, sigma=0.0, seconds_per_token=SECONDS_PER_TOKEN, slots=4
        )
        super().__init__(
            hf.model, ModelLimits.of(hf.model).vocab_size, hf.eos_token_ids[0], settings
        )
        self.spans: list[Span] = []
        self._record = threading.Lock()
        self._released = threading.Event()
        self._released.set()

    def hold(self) -> None:
        self._released.clear()

    def start_token(self) -> int:
        if not self._released.wait(HOLD_SECONDS):
            self._released.set()  # no load came: the hold ends for every sample
        return super().start_token()

    def compute_token(self, due: float) -> None:
        start, version = time.monotonic(), self.version
        super().compute_token(due)
        self.add(Span("token", start, time.monotonic(), version, self.version))

    def load_state_dict(self, tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        start, before = time.monotonic(), self.version
        self._released.set()
        time.sleep(LOAD_SECONDS)
        self.version = self.version + 1 if version is None else version
        self.add(Span("load", start, time.monotonic(), before, self.version))

    def add(self, span: Span) -> None:
        with self._record:
            self.spans.append(span)

    def of(self, kind: str) -> list[Span]:
        with self._record:
            return [s for s in self.spans if s.kind == kind]


@asynccontextmanager
async def worker(
    url: str, topology: Topology, model_dir: Path, partial: bool
) -> AsyncIterator[tuple[JetStreamContext, RecordingSimulated]]:
    engine = RecordingSimulated(model_dir)
    rollout = {"engine": "simulated", "partial": partial}
    async with served_rollout(url, topology, model_dir, engine, rollout) as (_, js, _, served):
        assert served.copies.continuous and served.copies.partial == partial
        yield js, engine


async def publish_prompts(js: JetStreamContext, topology: Topology, first: int, count: int) -> None:
    for index in range(first, first + count):
        event = PromptEvent(
            id=f"{topology.run}/0/{index}",
            run=topology.run,
            epoch=0,
            index=index,
            token_ids=Tensor.from_numpy(np.array([3, 4, 5, 6], np.int32)),
            n=GROUP,
            sampling=PromptSampling(max_tokens=TOKENS + 10),
        )
        await js.publish(topology.subject(PROMPTS), encode(event))


async def publish_weights(
    js: JetStreamContext, topology: Topology, engine: RecordingSimulated, version: int
) -> None:
    params = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    event = await store_weights(js, topology, version, params)
    await js.publish(topology.subject(WEIGHTS), encode(event))


async def stored(js: JetStreamContext, topology: Topology) -> list[TrajectoryEvent]:
    """Every sample stored (continuous admission: each its own event)."""
    samples = await stream_samples(js, topology, TRAJECTORIES)
    return [t for t in samples if isinstance(t, TrajectoryEvent)]


async def eventually(check: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"within {timeout:.0f} s: {what} did not happen"
        await asyncio.sleep(0.05)


def run_flow(
    url: str, topology: Topology, model_dir: Path, partial: bool
) -> tuple[RecordingSimulated, list[TrajectoryEvent]]:
    """Prompts flowing on 4 slots, versions 1..LOADS published while samples are mid-way."""

    async def main() -> tuple[RecordingSimulated, list[TrajectoryEvent]]:
        async with worker(url, topology, model_dir, partial) as (js, engine):
            await publish_weights(js, topology, engine, 0)
            prompts = 0
            for version in range(1, LOADS + 1):
                await publish_prompts(
                    js, topology, prompts, 8
                )  # 16 samples: four rounds of the 4 slots
                prompts += 8
                before = len(engine.of("token"))

                async def mid_way(before: int = before) -> bool:
                    # Each slot a sample past the last load (whatever was in flight then has
                    # ended: a sample meets one load here) and a third into the next.
                    return len(engine.of("token")) >= before + 4 * (TOKENS + TOKENS // 3)

                await eventually(mid_way, f"samples mid-way before v{version}")
                if partial:  # a drain would wait out the hold
                    engine.hold()
                await publish_weights(js, topology, engine, version)

                async def loaded(version: int = version) -> bool:
                    return len(engine.of("load")) == version

                await eventually(loaded, f"v{version} loaded")

            async def all_stored() -> bool:
                return (
                    await js.stream_info(topology.stream(TRAJECTORIES))
                ).state.messages == prompts * GROUP

            await eventually(all_stored, f"{prompts * GROUP} trajectories stored")
            return engine, await stored(js, topology)

    return asyncio.run(main())


def test_a_version_loads_between_two_tokens_and_the_samples_in_flight_go_on_with_it(
    nats_server: EmbeddedNats, topology: Topology, model_dir: Path
) -> None:
    engine, trajectories = run_flow(nats_server.url, topology, model_dir, partial=True)
    loads, tokens = engine.of("load"), engine.of("token")
    assert [load.version_at_end for load in loads] == list(range(1, LOADS + 1))
    clashes = [
        (t, load) for t in tokens for load in loads if t.start < load.end and load.start < t.end
    ]
    assert not clashes, f"{len(clashes)} tokens computed while weights loaded, first: {clashes[0]}"
    mixed = [t for t in tokens if t.version_at_start != t.version_at_end]
    assert not mixed, f"a token computed across a load: {mixed[0]}"
    taken: dict[int, int] = {}
    for t in trajectories:
        versions = t.versions.numpy()
        steps = np.diff(versions)
        assert (steps >= 0).all(), f"{t.id}: versions go backwards: {versions.tolist()}"
        assert (steps > 0).sum() <= 1, (
            f"{t.id}: versions change at more than one point: {versions.tolist()}"
        )
        if steps.any():
            taken[int(versions[-1])] = taken.get(int(versions[-1]), 0) + 1
    # Each load came with every slot mid-way into a sample (more queued): those went on with it.
    assert all(taken.get(v, 0) >= 1 for v in range(1, LOADS + 1)), (
        f"samples that took each version mid-way (partial rollout): {taken}; "
        "the samples in flight were drained instead of resumed with the new weights"
    )


def test_without_partial_rollout_a_load_waits_for_the_samples_in_flight(
    nats_server: EmbeddedNats, topology: Topology, model_dir: Path
) -> None:
    engine, trajectories = run_flow(nats_server.url, topology, model_dir, partial=False)
    tokens, loads = engine.of("token"), engine.of("load")
    assert not [t for t in tokens for load in loads if t.start < load.end and load.start < t.end]
    for t in trajectories:
        assert len(set(t.versions.numpy().tolist())) == 1, f"{t.id}: tokens from several versions"


def with_versions(reward: RewardEvent, versions: list[int]) -> RewardEvent:
    """`reward` with its tokens computed by `versions` (one per response token)."""
    t = reward.trajectory
    data = t.model_dump() | {"versions": Tensor.from_numpy(np.asarray(versions, np.int32))}
    return RewardEvent(
        id=reward.id, run=reward.run, trajectory=TrajectoryEvent(**data), reward=reward.reward
    )


def test_a_group_whose_first_tokens_are_too_old_is_dropped_though_its_last_are_new(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    """One group a step, max_staleness 1. Two v0 groups make steps 0 and 1; at step 2 the
    oldest version allowed is 1. A group whose samples began under v0 and ended under v2
    (partial rollout) is dropped as stale; one begun under v1 and ended under v2 is step 2."""
    run = topology.run
    fillers = [group(run, i, (float(i), 0.0, 1.0, 0.5)) for i in (0, 1)]
    old_start = [with_versions(r, [0] * 4 + [2] * 4) for r in group(run, 2, (1.0, 0.0, 1.0, 0.0))]
    new_start = [with_versions(r, [1] * 4 + [2] * 4) for r in group(run, 3, (1.0, 0.0, 0.0, 0.0))]
    config = RunConfig(
        run=run,
        algorithm=AlgorithmConfig(prompts_per_step=1, max_staleness=1, max_group_wait_steps=10),
        trainer=TrainerConfig(micro_batch_tokens=64),
    )
    log = tmp_path / "buffer.log"

    async def body(js: JetStreamContext) -> None:
        await declare(js, topology, config)
        proc = start_buffer(nats_server.url, topology, log)
        try:
            await publish(js, topology, [r for g in fillers for r in g])

            async def state(what: str) -> str:
                return f"{what}: batches {summary(await batches(js, topology))}; log:\n{tail(log)}"

            async def two_steps() -> bool:
                return sorted(by_step(await batches(js, topology))) == [0, 1]

            await until(two_steps, SETTLE, lambda: state("steps 0 and 1"))
            await publish(js, topology, [*old_start, *new_start])

            async def settled() -> bool:
                return await drained(js, topology) and 2 in by_step(await batches(js, topology))

            await until(settled, SETTLE, lambda: state("step 2"))
        finally:
            stop_buffer(proc)
        stored = await batches(js, topology)
        old_id, new_id = (g[0].trajectory.prompt_id for g in (old_start, new_start))
        trained = {p for b in by_step(stored)[2] for p in b.step_prompt_ids}
        reason = await drop_record(js, topology, old_id)
        assert trained == {new_id}, (
            f"step 2 trained {trained}, not only {new_id}: {summary(stored)}"
        )
        assert reason is not None and "stale: version 0 < 1 at step 2" in reason, (
            f"the group begun under v0 was not dropped as stale by its oldest token: {reason!r}"
        )

    run_with_js(nats_server.url, body)
