"""The rollout worker's two promises, on a real nats-server with the real tiny HF engine.

- A prompt is acked only once all its trajectories are stored: while the trajectories
  stream refuses writes (server side: discard-new at its message limit), the prompt the
  worker generated stays unacked; once the stream takes writes again, its trajectories are
  stored and only then is it acked.
- Weights never change under a generation: the engine records when each `generate` and
  each `load_state_dict` ran (a load made slow, as a large model's is), weight versions are
  published while prompts keep flowing, and no generation overlaps a load; a generation
  reports the version it ran with, and a prompt published after a load carries that
  version or a later one. The load runs off the event loop, which keeps running (and so
  heartbeating the prompts the worker holds) while it lasts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo, DiscardPolicy
from nats.js.errors import KeyNotFoundError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bus.connection import JetStream, connect
from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.runtime import Runtime, attach, publish_config
from bus.stage import serve
from bus.topology import DEAD, PROMPTS, TRAJECTORIES, WEIGHTS, Topology, drop_key
from consumers.rollout import Rollout, rollout_stage
from consumers.weights import publish_version
from consumers.weights.filesystem import FilesystemTransport
from engines.hf_rollout import HFRolloutEngine
from engines.protocols import RolloutEngine, Sample, SamplingParams
from schemas import PromptEvent, Tensor, TrajectoryEvent, WeightVersionEvent, encode
from schemas import SamplingParams as PromptSampling
from schemas.config import RunConfig
from schemas.kv_records import DropRecord
from tests.helpers import dead_letters, store_weights, stream_samples

GROUP = 2
"""Samples per prompt."""
MAX_TOKENS = 6
LOAD_SECONDS = 0.8
"""How long a load takes: long enough that generation would surely start during it if the
gate stayed open while weights load."""
MAX_LOOP_STALL = 0.5
"""Longest the event loop may go without running while weights load: under LOAD_SECONDS,
so a load run on the loop's own thread is caught."""


@dataclass(frozen=True)
class Call:
    """One call into the engine, as it ran (monotonic clock, shared by all threads)."""

    kind: str
    """"generate" or "load"."""
    start: float
    end: float
    version_at_start: int
    version_at_end: int
    prompts: int = 0


class RecordingEngine(HFRolloutEngine):
    """The real engine, recording every generate and load; a load takes `load_seconds` more."""

    def __init__(self, model_dir: Path, load_seconds: float = 0.0) -> None:
        super().__init__(model_dir, seed=0)
        self.load_seconds = load_seconds
        self.calls: list[Call] = []
        self._lock = threading.Lock()  # generate and load run in worker threads

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        start, version = time.monotonic(), self.version
        try:
            return super().generate(prompts, n, params)
        finally:
            self._record(
                Call("generate", start, time.monotonic(), version, self.version, len(prompts))
            )

    def load_state_dict(self, tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        start, before = time.monotonic(), self.version
        time.sleep(self.load_seconds)  # a large model's bytes being copied in
        try:
            super().load_state_dict(tensors, version)
        finally:
            self._record(Call("load", start, time.monotonic(), before, self.version))

    def _record(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)

    def of(self, kind: str) -> list[Call]:
        with self._lock:
            return [call for call in self.calls if call.kind == kind]


@dataclass
class RolloutUnderTest:
    """One real rollout worker (batcher, weights watcher, worker loop) in this event loop."""

    nc: Client
    js: JetStream
    topology: Topology
    rt: Runtime
    engine: RecordingEngine
    rollout: Rollout
    published: int = 0

    async def publish_prompt(self, admitted_version: int = 0) -> PromptEvent:
        index = self.published
        self.published += 1
        event = PromptEvent(
            id=f"{self.topology.run}/0/{index}",
            run=self.topology.run,
            epoch=0,
            index=index,
            token_ids=Tensor.from_numpy(np.array([3, 4, 5, 6 + index % 4], np.int32)),
            n=GROUP,
            sampling=PromptSampling(max_tokens=MAX_TOKENS),
            admitted_version=admitted_version,
        )
        await self.js.publish(self.topology.subject(PROMPTS), encode(event))
        return event

    async def publish_weights(self, version: int) -> None:
        """Store version `version` (the model's weights, nudged) and announce it,
        as the trainer does."""
        params = {
            name: p.detach().clone() + 1e-3 * version
            for name, p in self.engine.model.named_parameters()
        }
        event = await store_weights(self.js, self.topology, version, params)
        await self.js.publish(self.topology.subject(WEIGHTS), encode(event))

    async def prompts_consumer(self) -> ConsumerInfo:
        return await self.js.consumer_info(
            self.topology.stream(PROMPTS), PROMPTS.work_queue.durable
        )

    async def trajectories(self) -> list[TrajectoryEvent]:
        """Every sample stored (a group's event holds n)."""
        stored = await stream_samples(self.js, self.topology, TRAJECTORIES)
        return [t for t in stored if isinstance(t, TrajectoryEvent)]


@asynccontextmanager
async def served_rollout(
    url: str,
    topology: Topology,
    model_dir: Path,
    engines: RolloutEngine | Sequence[RolloutEngine],
    rollout: dict[str, Any],
    *,
    weights: dict[str, Any] | None = None,
    ack_timeout: float = 10.0,
    sections: dict[str, Any] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> AsyncIterator[tuple[Client, JetStream, Runtime, Rollout]]:
    """A rollout stage built as `consumers.rollout.build` builds it (production options) over
    `engines`, served in this event loop until the block ends: the run's config has `rollout`
    and `weights` as its sections, and `sections` (more of them); its publisher waits
    `ack_timeout` s for an ack; `tokenizer` is the model dir's unless given. Yields the
    test's own connection, its JetStream context, the stage's runtime and the `Rollout`."""
    nc = await connect(url, "test-rollout")
    js = nc.jetstream()
    await topology.apply(js)
    config = RunConfig.model_validate(
        {
            "run": topology.run,
            "model": {"path": str(model_dir)},
            "rollout": rollout,
            "weights": weights or {},
            **(sections or {}),
        }
    )
    await publish_config(await js.key_value(topology.kv_bucket), config)
    rt = await attach("rollout", topology.run, url)
    rt.publisher = Publisher(rt.js, rt.topology, ack_timeout=ack_timeout)
    worker = Rollout(rt, engines, tokenizer or AutoTokenizer.from_pretrained(model_dir))
    stop = asyncio.Event()
    loop = asyncio.create_task(serve(rt, rollout_stage(worker), stop))
    try:
        yield nc, js, rt, worker
        assert not loop.done(), f"the stage ended: {loop.exception() if loop.done() else ''}"
    finally:
        stop.set()
        try:  # a failed test may leave handlers waiting on a generation that never comes
            await asyncio.wait_for(asyncio.shield(loop), 10)
        except Exception:  # teardown: whatever the stage ended with, clean up
            loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await rt.close()
        await topology.delete(js)
        await nc.close()


@asynccontextmanager
async def rollout_worker(
    url: str,
    topology: Topology,
    model_dir: Path,
    load_seconds: float = 0.0,
    ack_timeout: float = 10.0,
    weights: dict | None = None,
) -> AsyncIterator[RolloutUnderTest]:
    """`served_rollout` on one recording engine, two prompts a batch; `weights` is the run
    config's `weights` section."""
    engine = RecordingEngine(model_dir, load_seconds)
    async with served_rollout(
        url,
        topology,
        model_dir,
        engine,
        {"max_batch_prompts": 2},
        weights=weights,
        ack_timeout=ack_timeout,
    ) as (nc, js, rt, rollout):
        yield RolloutUnderTest(nc, js, topology, rt, engine, rollout)


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], what: str, timeout: float = 30.0
) -> None:
    """Poll `check` until it holds; fail saying `what` did not happen within `timeout` s."""
    deadline = time.monotonic() + timeout
    while not await holds(check):
        assert time.monotonic() < deadline, f"within {timeout:.0f} s: {what} did not happen"
        await asyncio.sleep(0.05)


async def holds(check: Callable[[], bool | Awaitable[bool]]) -> bool:
    result = check()
    return await result if inspect.isawaitable(result) else bool(result)


# --- a prompt is acked only once its trajectories are stored ----------------------------

REFUSAL_HOLD = 2.5
"""Seconds the trajectories stream refuses writes with a generated prompt waiting: more than
the publisher's ack timeout (1 s here) and a few of its retries."""


async def refuse_writes(js: JetStreamContext, stream: str) -> int:
    """Make `stream` refuse every new message (discard new, at its current count);
    returns the count."""
    info = await js.stream_info(stream)
    count = info.state.messages
    assert count > 0, "max_msgs 0 means no limit: store something first"
    await js.update_stream(
        dataclasses.replace(info.config, discard=DiscardPolicy.NEW, max_msgs=count)
    )
    return count


async def accept_writes(js: JetStreamContext, stream: str) -> None:
    info = await js.stream_info(stream)
    await js.update_stream(dataclasses.replace(info.config, discard=DiscardPolicy.OLD, max_msgs=-1))


def test_prompt_is_acked_only_once_its_trajectories_are_stored(
    nats_server: EmbeddedNats, topology: Topology, model_dir: Path
) -> None:
    async def main() -> None:
        async with rollout_worker(nats_server.url, topology, model_dir, ack_timeout=1.0) as w:
            stream = topology.stream(TRAJECTORIES)
            await w.publish_weights(0)  # opens the gate, as the trainer's v0 does

            async def acked(count: int) -> bool:
                info = await w.prompts_consumer()
                assert info.ack_floor is not None  # the server sends it
                return info.ack_floor.stream_seq == count and info.num_ack_pending == 0

            # A prompt flows while storing works: its trajectories stored, then it is acked.
            await w.publish_prompt()
            await eventually(lambda: acked(1), "the first prompt was acked")
            assert len(await w.trajectories()) == GROUP

            stored = await refuse_writes(w.js, stream)
            second = await w.publish_prompt()
            await eventually(
                lambda: len(w.engine.of("generate")) == 2, "the second prompt was generated"
            )
            deadline = time.monotonic() + REFUSAL_HOLD
            while time.monotonic() < deadline:
                info = await w.prompts_consumer()
                assert info.ack_floor is not None  # the server sends it
                assert info.ack_floor.stream_seq == 1 and info.num_ack_pending == 1, (
                    f"{second.id} was acked while its trajectories could not be stored "
                    f"(ack floor {info.ack_floor.stream_seq}, ack pending {info.num_ack_pending})"
                )
                messages = (await w.js.stream_info(stream)).state.messages
                assert messages == stored, (
                    f"the stream was to refuse writes, yet holds {messages} (had {stored})"
                )
                await asyncio.sleep(0.1)

            await accept_writes(w.js, stream)
            await eventually(
                lambda: acked(2), f"{second.id} was acked once its trajectories could be stored"
            )
            ids = sorted(t.id for t in await w.trajectories())
            assert ids == sorted(
                f"{p}/{i}" for p in (f"{topology.run}/0/0", second.id) for i in range(GROUP)
            ), f"each trajectory stored once: {ids}"

    asyncio.run(main())


# --- weights never change under a generation ---------------------------------------------

LOADS = 3
"""Weight versions published while prompts flow."""


def overlaps(a: Call, b: Call) -> bool:
    return a.start < b.end and b.start < a.end


async def tick(stop: asyncio.Event, ticks: list[float]) -> None:
    """Record when the event loop runs, every 20 ms, until `stop`."""
    while not stop.is_set():
        ticks.append(time.monotonic())
        await asyncio.sleep(0.02)


def longest_stall(ticks: list[float], during: Call) -> float:
    """The longest the loop went without running, over the gaps between ticks that meet `during`."""
    gaps = [
        b - a for a, b in zip(ticks, ticks[1:], strict=False) if a < during.end and b > during.start
    ]
    return max(gaps, default=during.end - during.start)


async def feed(w: RolloutUnderTest, stop: asyncio.Event, published_at: dict[str, float]) -> None:
    """Keep prompts waiting in the queue until `stop`, so that the worker always has more to
    generate."""
    while not stop.is_set():
        pending = (await w.prompts_consumer()).num_pending
        assert pending is not None  # the server sends it
        if pending < 4:
            for _ in range(8):
                published_at[(await w.publish_prompt()).id] = time.monotonic()
        await asyncio.sleep(0.05)


def test_weights_load_only_between_generations_and_off_the_event_loop(
    nats_server: EmbeddedNats, topology: Topology, model_dir: Path
) -> None:
    async def main() -> None:
        async with rollout_worker(
            nats_server.url, topology, model_dir, load_seconds=LOAD_SECONDS
        ) as w:
            await w.publish_weights(0)
            published_at: dict[str, float] = {}
            ticks: list[float] = []
            stop = asyncio.Event()
            feeder = asyncio.create_task(feed(w, stop, published_at))
            ticker = asyncio.create_task(tick(stop, ticks))
            try:
                for version in range(1, LOADS + 1):
                    # Generation is under way (more prompts waiting) when each version comes.
                    before = len(w.engine.of("generate"))
                    await eventually(
                        lambda: len(w.engine.of("generate")) >= before + 2,  # noqa: B023
                        f"two generations before v{version}",
                    )
                    await w.publish_weights(version)
                    await eventually(
                        lambda: len(w.engine.of("load")) == version,  # noqa: B023
                        f"v{version} was loaded",
                    )
            finally:
                stop.set()
                await asyncio.gather(feeder, ticker)
            total = len(published_at)
            await eventually(
                lambda: sum(c.prompts for c in w.engine.of("generate")) >= total,
                f"all {total} prompts were generated",
            )
            await eventually(
                lambda: trajectories_stored(w, total * GROUP),
                f"{total * GROUP} trajectories stored",
            )

            loads, generations = w.engine.of("load"), w.engine.of("generate")
            assert [load.version_at_end for load in loads] == list(range(1, LOADS + 1))
            clashes = [(g, load) for g in generations for load in loads if overlaps(g, load)]
            assert not clashes, (
                f"{len(clashes)} generations ran while weights loaded, first: {clashes[0]}"
            )
            for load in (
                loads
            ):  # each load came in the middle of the flow, or the check above proves nothing
                assert any(g.end <= load.start for g in generations), (
                    f"no generation before the load of {load}"
                )
                assert any(g.start >= load.end for g in generations), (
                    f"no generation after the load of {load}"
                )
            stalls = [longest_stall(ticks, load) for load in loads]
            assert max(stalls) < MAX_LOOP_STALL, (
                f"the event loop stood still for {max(stalls):.2f} s during a {LOAD_SECONDS} s "
                "load: the load ran on its thread, and no heartbeat went out meanwhile"
            )
            for g in generations:
                served = max(
                    (load.version_at_end for load in loads if load.end <= g.start), default=0
                )
                assert g.version_at_start == g.version_at_end == served, (
                    f"a generation that started after v{served} was loaded ran with "
                    f"v{g.version_at_start}..v{g.version_at_end}: {g}"
                )
            for t in await w.trajectories():
                versions = set(t.versions.numpy().tolist())
                assert len(versions) == 1, f"{t.id}: tokens from several versions {versions}"
                newest_before = max(
                    (
                        load.version_at_end
                        for load in loads
                        if load.end <= published_at[t.prompt_id]
                    ),
                    default=0,
                )
                assert versions.pop() >= newest_before, (
                    f"{t.id}: published after v{newest_before} was loaded, "
                    "yet generated with an older version"
                )

    asyncio.run(main())


async def trajectories_stored(w: RolloutUnderTest, count: int) -> bool:
    """Whether `count` samples are stored, whatever events carry them."""
    return len(await w.trajectories()) >= count


# --- a prompt the model can never generate is recorded as dropped -------------------------


def test_a_prompt_the_model_cannot_take_is_recorded_as_dropped_for_the_gate(
    nats_server: EmbeddedNats, topology: Topology, model_dir: Path
) -> None:
    """The gate counted the prompt as issued; without a drop record it waits for a group that
    never comes and the run stops short of its last step. A valid prompt after it still flows."""

    async def main() -> None:
        async with rollout_worker(nats_server.url, topology, model_dir) as w:
            await w.publish_weights(0)
            unknown_token = w.engine.model.config.vocab_size + 5
            refused = PromptEvent(
                id=f"{topology.run}/0/99",
                run=topology.run,
                epoch=0,
                index=99,
                n=GROUP,
                token_ids=Tensor.from_numpy(np.array([3, unknown_token], np.int32)),
                sampling=PromptSampling(max_tokens=MAX_TOKENS),
            )
            await w.js.publish(topology.subject(PROMPTS), encode(refused))
            kv = await w.js.key_value(topology.kv_bucket)

            async def recorded() -> bool:
                try:
                    return bool((await kv.get(drop_key(refused.id))).value)
                except KeyNotFoundError:
                    return False

            await eventually(recorded, f"a drop record for {refused.id}")
            drop = DropRecord.decode((await kv.get(drop_key(refused.id))).value)
            assert drop.refused and drop.reason.startswith("rejected:"), drop
            assert str(unknown_token) in drop.reason, drop
            await w.publish_prompt()
            await eventually(
                lambda: trajectories_stored(w, GROUP), "the next prompt's trajectories were stored"
            )

    asyncio.run(main())


# --- a version that cannot be loaded leaves the worker serving what it has ----------------


def test_a_version_whose_file_is_damaged_or_pruned_leaves_the_worker_serving_the_old_one(
    nats_server: EmbeddedNats, topology: Topology, model_dir: Path, tmp_path: Path
) -> None:
    """Filesystem transport: v1 loads; v2's file is damaged after it was announced, so v2 is
    refused (dead-lettered, never loaded) and generation goes on with v1. While v3 loads, v4
    (whose file is already pruned) and v5 are announced: v4 is skipped without a dead letter,
    since a newer version is announced, and v5 loads."""

    async def main() -> None:
        weights = {"transport": "filesystem", "dir": str(tmp_path), "keep": 5}
        async with rollout_worker(
            nats_server.url, topology, model_dir, load_seconds=LOAD_SECONDS, weights=weights
        ) as w:
            transport = FilesystemTransport(tmp_path / topology.run, keep=5)

            async def store(version: int) -> WeightVersionEvent:
                params = {
                    n: p.detach().clone() + 1e-3 * version
                    for n, p in w.engine.model.named_parameters()
                }
                return await publish_version(transport, topology.run, "test", version, params)

            async def announce(event: WeightVersionEvent) -> None:
                await w.js.publish(topology.subject(WEIGHTS), encode(event))

            await announce(await store(1))
            await eventually(lambda: w.engine.version == 1, "v1 was loaded")
            damaged = await store(2)
            path = Path(damaged.location)
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x01
            path.write_bytes(bytes(data))
            await announce(damaged)
            await eventually(
                lambda: w.engine.version != 1 or dead_stored(w, 1), "v2 was loaded or refused"
            )
            assert w.engine.version == 1, f"the damaged v2 was loaded: now v{w.engine.version}"
            assert w.rollout.open_for_requests.is_set(), "v2 refused, yet the gate stayed closed"
            before = len(w.engine.of("generate"))
            await w.publish_prompt()
            await eventually(
                lambda: len(w.engine.of("generate")) > before, "a prompt was generated after v2"
            )
            assert w.engine.of("generate")[-1].version_at_start == 1

            loading, pruned, newest = await store(3), await store(4), await store(5)
            Path(pruned.location).unlink()
            await announce(loading)
            # The watcher handles one event at a time: both come while v3 loads (the gate shut).
            await eventually(lambda: not w.rollout.open_for_requests.is_set(), "v3 began to load")
            await announce(pruned)
            await announce(newest)
            await eventually(lambda: w.engine.version == 5, "v5 was loaded")
            assert [load.version_at_end for load in w.engine.of("load")] == [1, 3, 5]
            reasons = [reason for _, reason in await dead_letters(w.js, topology)]
            assert (
                len(reasons) == 1 and "tensor" in reasons[0] and "does not match" in reasons[0]
            ), reasons

    asyncio.run(main())


async def dead_stored(w: RolloutUnderTest, count: int) -> bool:
    """Whether at least `count` dead letters are stored."""
    return (await w.js.stream_info(w.topology.stream(DEAD))).state.messages >= count


# --- a prompt is generated with the weights it was admitted at ----------------------------


def test_a_prompt_waits_for_the_version_it_was_admitted_at_unless_that_version_is_refused(
    nats_server: EmbeddedNats, topology: Topology, model_dir: Path
) -> None:
    """The gate admits a prompt at v1 as soon as v1 is announced; the worker still serves v0.
    Generated then, its samples would be v0's and dropped as stale: it waits until v1 is
    loaded (the load made slow). A prompt admitted at a version the worker refuses (its file
    damaged) does not wait for it: it is generated with the version served, at once."""

    async def main() -> None:
        async with rollout_worker(
            nats_server.url, topology, model_dir, load_seconds=LOAD_SECONDS
        ) as w:
            await w.publish_weights(0)
            await w.publish_prompt()
            await eventually(lambda: trajectories_stored(w, GROUP), "the v0 prompt's samples")
            early = await w.publish_prompt(admitted_version=1)
            await asyncio.sleep(1.0)  # time enough to generate it with v0, were it not waiting
            assert not await trajectories_stored(w, 2 * GROUP), "generated before v1 came"
            await w.publish_weights(1)
            await eventually(lambda: trajectories_stored(w, 2 * GROUP), "the v1 prompt's samples")
            mine = [t for t in await w.trajectories() if t.prompt_id == early.id]
            versions = {int(v) for t in mine for v in t.versions.numpy()}
            assert len(mine) == GROUP and versions == {1}, versions

            # v2 with a tensor of another shape: refused by the worker, which serves v1 on.
            params = {n: p.detach().clone() for n, p in w.engine.model.named_parameters()}
            name = next(iter(params))
            params[name] = params[name].flatten()[:-1]
            event = await store_weights(w.js, topology, 2, params)
            await w.js.publish(topology.subject(WEIGHTS), encode(event))
            await eventually(lambda: dead_stored(w, 1), "v2 was refused")
            late = await w.publish_prompt(admitted_version=2)
            started = time.monotonic()
            await eventually(lambda: trajectories_stored(w, 3 * GROUP), "the v2 prompt's samples")
            assert time.monotonic() - started < 15, "it waited for a version that never loads"
            mine = [t for t in await w.trajectories() if t.prompt_id == late.id]
            assert {int(v) for t in mine for v in t.versions.numpy()} == {1}

    asyncio.run(main())
