"""Poison in every stream: it goes to `dead` with a reason (or is scored as a failed sample),
no worker stops, and the valid events behind it still flow.

- `decode` returns an event that is safe to use, or raises DecodeError: never anything else.
- A burst of messages at the max payload is dead-lettered (cut to fit) without the worker's
  connection being dropped for falling behind.
- The real workers on a real nats-server (rollout, reward and buffer stages built by their
  own builders and served as in production, in one event loop on a thread of this process;
  the trainer as a subprocess): one message of each kind the issue
  lists, then hypothesis-made poison, go into prompts, trajectories, rewards, batches.0 and
  weights, each followed by valid events whose outputs are waited for (trajectories;
  rewards, a failed one among them; a batch, a train step and the new weights served).
  Token ids and lengths the model cannot take are refused where the model is.
- With the reference stage (`reference.enabled`): the same kinds of poison into `rewards` (read
  by the reference stage) and `scored` (read by the buffer), plus samples each must refuse,
  then a valid group that comes out as a batch with reference log-probs.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from transformers import AutoModelForCausalLM

from bus.connection import connect
from bus.dead import HEADERS_ROOM, REASON, SEQUENCE, STAGE, SUBJECT, TRUNCATED
from bus.embedded import MAX_PAYLOAD, EmbeddedNats
from bus.publisher import Publisher
from bus.runtime import Runtime, attach, publish_config
from bus.stage import Builder, Stage, serve
from bus.topology import (
    BATCHES,
    CHANNELS,
    DEAD,
    PROMPTS,
    REWARDS,
    SCORED,
    TRAJECTORIES,
    WEIGHTS,
    Channel,
    Topology,
)
from bus.worker import Worker, WorkerOptions
from consumers import buffer as buffer_stage
from consumers import reference as reference_stage
from consumers import reward as reward_stage
from consumers import rollout as rollout_stage
from consumers.checks import ModelLimits
from engines.tiny import build_tiny_model
from producers.tasks import VOCAB
from schemas import (
    BatchEvent,
    DecodeError,
    Event,
    PromptEvent,
    RewardEvent,
    Rewards,
    SamplingParams,
    Tensor,
    Trajectories,
    TrajectoryEvent,
    WeightVersionEvent,
    decode,
    encode,
)
from schemas.codec import EVENT_TYPES
from schemas.config import RunConfig
from tests.golden_events import golden
from tests.helpers import store_weights, trajectory
from tests.poison import GOLDEN_MAPS, malformed, one_of_each_kind, undecodable

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
Key = tuple[str, int]
"""A message by its original subject and stream sequence, as its dead letter names it."""

TOKEN = {symbol: index for index, symbol in enumerate(VOCAB)}
VOCAB_SIZE, CONTEXT = len(VOCAB), 64
"""The tiny model's limits (`build_tiny_model` defaults); the fleet checks them."""
MAX_TOKENS = 4
FAR_VERSION = 10**6
"""A weight version no trainer reaches in these tests: offered, it is always newer."""
CHANNEL = {
    channel.name: channel
    for channel in CHANNELS
    if channel.event is not None and channel is not SCORED
}
"""Every channel that carries events in a run without the reference stage, by name (the tests'
parameter); `scored`, and `rewards` read by the reference stage: `test_reference_stage_poison`."""
STREAMS = tuple(CHANNEL)
READER = {name: channel.readers[0].role for name, channel in CHANNEL.items()}
"""The stage that consumes each stream, and so dead-letters what it cannot use."""
GOLDEN_NAME = {
    "prompts": "prompt.v1",
    "trajectories": "trajectory.v2",
    "rewards": "reward.v2",
    "batches": "batch.v1",
    "weights": "weights.v1",
}
EVENT = {name: channel.event for name, channel in CHANNEL.items()}


# --- decode ----------------------------------------------------------------------------


def assert_safe(event: Event) -> None:
    """What the workers take for granted in a decoded event, checked on its arrays directly."""
    assert math.isfinite(event.time)
    if isinstance(event, RewardEvent):
        assert all(map(math.isfinite, [event.reward, *event.components.values()]))
        assert event.id == event.trajectory.id
        event = event.trajectory
    if isinstance(event, PromptEvent) and event.token_ids is not None:
        ids = event.token_ids.numpy()
        assert ids.dtype == np.int32 and ids.size > 0 and ids.min() >= 0
    if isinstance(event, TrajectoryEvent):
        for tensor in (event.prompt_ids, event.response_ids, event.versions):
            assert tensor.numpy().dtype == np.int32
        for tensor in (event.prompt_ids, event.response_ids):
            assert (tensor.numpy() >= 0).all()
        assert event.prompt_ids.numpy().size > 0
        logprobs = event.logprobs.numpy()
        assert (
            logprobs.dtype == np.float32 and np.isfinite(logprobs).all() and (logprobs <= 0).all()
        )
        # Versions >= 0 on the model's tokens; an episode's environment tokens: -1 and 0.0.
        trained, versions = event.trained_mask(), event.versions.numpy()
        assert trained.shape == versions.shape and (versions[trained] >= 0).all()
        assert (versions[~trained] == -1).all() and (logprobs[~trained] == 0).all()
        assert trained.any() or trained.size == 0
    if isinstance(event, BatchEvent):
        ids, attention, loss = (
            event.input_ids.numpy(),
            event.attention_mask.numpy(),
            event.loss_mask.numpy(),
        )
        assert ids.dtype == np.int32 and ids.size > 0 and ids.min() >= 0
        assert set(np.unique(attention)) <= {0, 1} and (loss <= attention).all()
        for tensor in (event.advantages, event.rewards, event.behaviour_logprobs):
            assert tensor.numpy().dtype == np.float32 and np.isfinite(tensor.numpy()).all()
        assert (event.behaviour_logprobs.numpy() <= 0).all()
        trained = event.versions.numpy()[loss == 1]
        assert ((trained >= 0) & (trained <= event.step)).all()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.sampled_from(sorted(GOLDEN_MAPS)).flatmap(malformed),
    expected=st.sampled_from([Event, *EVENT_TYPES]),
)
def test_decode_returns_a_safe_event_or_raises_decode_error(
    data: bytes, expected: type[Event]
) -> None:
    try:
        event = decode(data, expected)
    except DecodeError as exc:
        assert str(exc) and "\n" not in str(exc)  # one line: it becomes a log line and a header
        return
    assert isinstance(event, expected)
    assert_safe(event)
    assert decode(encode(event), type(event)) == event


# --- the fetch budget -------------------------------------------------------------------


@dataclass(frozen=True)
class Dead:
    """A dead letter: who wrote it, why, and what it kept of the original."""

    stage: str
    reason: str
    data: bytes
    original_size: int | None
    """Set when only the start of the original was kept."""


async def dead_letters(js: JetStreamContext, topology: Topology) -> dict[Key, Dead]:
    """Every dead letter of the run, by the message it stands for."""
    sub = await js.subscribe(topology.subject(DEAD, ">"), ordered_consumer=True)
    found = {}
    for _ in range((await js.stream_info(topology.stream(DEAD))).state.messages):
        key, dead = as_dead(await sub.next_msg(timeout=10))
        found[key] = dead
    await sub.unsubscribe()
    return found


def as_dead(msg: Msg) -> tuple[Key, Dead]:
    """A dead letter read from its headers, keyed by its original subject and sequence."""
    headers = msg.headers or {}
    size = headers.get(TRUNCATED)
    dead = Dead(headers[STAGE], headers[REASON], msg.data, int(size) if size else None)
    return (headers[SUBJECT], int(headers[SEQUENCE])), dead


def test_a_burst_of_max_size_messages_goes_dead_without_dropping_the_connection(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """16 messages at the max payload (128 MiB) and a valid event behind them: each goes to
    dead with its start kept, the valid one is handled, and the worker is never disconnected
    (a fetch of all 16 at once, or a dead letter over the max payload, would have been)."""
    count, handled = 16, []

    async def handler(event: Trajectories, _msg: Msg) -> None:
        handled.append(event.id)

    async def main() -> None:
        nc = await connect(nats_server.url, "test-burst")
        js = nc.jetstream()
        await topology.apply(js)
        subject = topology.subject(TRAJECTORIES)
        keys = {
            (subject, (await js.publish(subject, bytes([0xC1]) * MAX_PAYLOAD)).seq)
            for _ in range(count)
        }
        publisher = Publisher(js, topology)
        await publisher.publish(TRAJECTORIES, trajectory(topology.run))
        options = WorkerOptions(concurrency=32, fetch_timeout=0.2)
        stop = asyncio.Event()
        task = asyncio.create_task(
            Worker(js, topology, TRAJECTORIES, handler, publisher, options).run(stop)
        )
        try:
            await eventually(
                lambda: bool(handled) and len(keys) == count, "the valid event is handled"
            )
            await eventually_async(
                lambda: dead_count(js, topology, count), "every max-size message is dead", 60
            )
            dead = await dead_letters(js, topology)
            assert set(dead) == keys
            assert {
                (d.original_size, len(d.data), d.reason.split(":")[0]) for d in dead.values()
            } == {(MAX_PAYLOAD, MAX_PAYLOAD - HEADERS_ROOM, "not msgpack")}
            assert nc.stats["reconnects"] == 0
        finally:
            stop.set()
            await task
            await topology.delete(js)  # 256 MiB the rest of the session need not keep
            await nc.close()

    asyncio.run(main())


async def dead_count(js: JetStreamContext, topology: Topology, count: int) -> bool:
    """Whether the run's dead stream holds at least `count` letters."""
    return (await js.stream_info(topology.stream(DEAD))).state.messages >= count


async def eventually(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait until `predicate` holds; fail the test after `timeout` s."""

    async def check() -> bool:
        return predicate()

    await eventually_async(check, what, timeout)


async def eventually_async(
    check: Callable[[], Awaitable[bool]], what: str, timeout: float = 30.0
) -> None:
    """Wait until `check()` holds; fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.05)


# --- the fleet --------------------------------------------------------------------------


def tokens(text: str) -> list[int]:
    """The tiny tokenizer's ids of `text` (one symbol, one token)."""
    return [TOKEN[symbol] for symbol in text]


def ids_tensor(values: list[int] | np.ndarray) -> Tensor:
    """Token ids (or versions) as they travel: int32."""
    return Tensor.from_numpy(np.asarray(values, dtype=np.int32))


def scored(
    prompt_id: str, sample: int, group: int, response: list[int], reward: float
) -> RewardEvent:
    """A RewardEvent for `response` (ids, which need not be in the vocabulary) to prompt
    "c1234="."""
    n = len(response)
    t = TrajectoryEvent(
        id=f"{prompt_id}/{sample}",
        run=prompt_id.split("/")[0],
        prompt_id=prompt_id,
        sample_index=sample,
        group_size=group,
        prompt_ids=ids_tensor(tokens("c1234=")),
        response_ids=ids_tensor(response),
        logprobs=Tensor.from_numpy(np.full(n, -1.0, np.float32)),
        versions=ids_tensor(np.zeros(n, np.int32)),
        response_text="",
        task={"name": "digits", "rule": "copy", "target": "1234"},
    )
    return RewardEvent(id=t.id, run=t.run, trajectory=t, reward=reward)


@dataclass
class Observed:
    """What the fleet's streams hold, read as it arrives (poison left out, except in `dead`)."""

    dead: dict[Key, Dead] = field(default_factory=dict)
    trajectories: set[str] = field(default_factory=set)
    rewards: dict[str, RewardEvent] = field(default_factory=dict)
    batches: list[BatchEvent] = field(default_factory=list)
    weights: set[int] = field(default_factory=set)


class Fleet:
    """The real workers of one run: rollout, reward and buffer as tasks of an event loop on a
    thread of this process, the trainer as a subprocess; tests drive it with `call`."""

    def __init__(self, url: str, topology: Topology, model_dir: Path, work: Path) -> None:
        self.url, self.topology, self.model_dir, self.work = url, topology, model_dir, work
        self.run = topology.run
        self.config = RunConfig.model_validate(
            {
                "run": self.run,
                "model": {"path": str(model_dir)},
                "data": {
                    "reward": "producers.tasks:score_digits",
                    "n": 2,
                    "sampling": {"max_tokens": MAX_TOKENS},
                },
                # One group a step: every valid group behind poison makes a step of its own.
                "algorithm": {"prompts_per_step": 1, "max_staleness": 10**6},
                "trainer": {
                    "steps": 10**6,
                    "checkpoint_every": 10**6,
                    "checkpoint_dir": str(work / "checkpoints"),
                },
                "rollout": {"max_batch_prompts": 4},
                "reward": {"processes": 1, "timeout": 10.0},
            }
        )
        self.seen = Observed()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.counter = itertools.count()
        self.stop = asyncio.Event()
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self.runtimes: list[Runtime] = []
        self.stages: list[Stage[Any]] = []
        self.refused_weights: list[bytes] = []
        """Weight events that decode but must be refused: forged checksum, missing object,
        bad bytes, wrong shapes."""
        self.held_group = f"{self.run}/held"
        """A group of two of which the buffer holds one sample for good
        (poison claims another size for it)."""

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        """Run `coro` on the fleet's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # Start and stop -------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()
        self.call(self._start())

    async def _start(self) -> None:
        self.nc: Client = await connect(self.url, "test-fleet")
        self.js = self.nc.jetstream()
        await self.topology.apply(self.js)
        await publish_config(await self.js.key_value(self.topology.kv_bucket), self.config)
        self.trainer_log = open(self.work / "trainer.log", "wb")  # noqa: SIM115 - closed in stop()
        self.trainer = subprocess.Popen(
            [sys.executable, "-m", "consumers.trainer", "--run", self.run, "--nats", self.url],
            cwd=ROOT,
            stdout=self.trainer_log,
            stderr=subprocess.STDOUT,
        )
        for channel in (TRAJECTORIES, REWARDS, WEIGHTS, BATCHES):
            observer = self._observe(self.topology.subjects(channel), channel.event)  # type: ignore[arg-type]
            self.tasks[f"observe {channel.name}"] = asyncio.create_task(observer)
        self.tasks["observe dead"] = asyncio.create_task(self._observe_dead())
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir)
        assert ModelLimits.of(self.model) == ModelLimits(VOCAB_SIZE, CONTEXT)
        self.rollout_rt = await self._start_stage("rollout", rollout_stage.build)
        await self._start_stage("reward", reward_stage.build)
        await self._start_stage("buffer", buffer_stage.build)
        # Ready once the rollout watches weights and the trainer has published version 0.
        await eventually_async(self._watching_weights, "the rollout watches the weights stream")
        await self.until(lambda: 0 in self.seen.weights, "the trainer publishes version 0", 120)
        await self._store_refused_weights()
        await self.js.publish(
            self.subject(REWARDS), encode(scored(self.held_group, 0, 2, [1], 1.0))
        )

    async def _start_stage(self, role: str, build: Builder) -> Runtime:
        """Build the role's stage as its `python -m consumers.<role>` does, and serve it."""
        rt = await self._attach(role)
        stage = await build(rt)
        self.stages.append(stage)
        self.tasks[role] = asyncio.create_task(serve(rt, stage, self.stop))
        return rt

    async def _attach(self, role: str) -> Runtime:
        rt = await attach(role, self.run, self.url)
        self.runtimes.append(rt)
        return rt

    async def _watching_weights(self) -> bool:
        return (await self.js.stream_info(self.topology.stream(WEIGHTS))).state.consumer_count >= 2

    async def _store_refused_weights(self) -> None:
        """Weight events that decode but must never be loaded, all for a version far ahead."""
        model = self.model
        params = {name: param.detach().clone() for name, param in model.named_parameters()}
        good = await store_weights(self.js, self.topology, FAR_VERSION, params)
        await (await self.js.object_store(self.topology.object_bucket)).put(
            "corrupt.safetensors", b"\x00" * 64
        )
        first, *rest = good.manifest
        self.refused_weights = [
            encode(event)
            for event in (
                good.model_copy(
                    update={"manifest": (first.model_copy(update={"sha256": "0" * 64}), *rest)}
                ),
                good.model_copy(update={"location": "missing.safetensors"}),
                good.model_copy(update={"location": "corrupt.safetensors"}),
                good.model_copy(
                    update={"manifest": (first.model_copy(update={"shape": (1, 1)}), *rest)}
                ),
                good.model_copy(update={"manifest": tuple(rest)}),
            )
        ]

    def stop_all(self) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _stop(self) -> None:
        self.assert_alive()
        self.stop.set()
        for name in ("rollout", "reward", "buffer"):
            await self.tasks.pop(name)
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        for stage in self.stages:
            if stage.close is not None:
                await stage.close()
        self.trainer.send_signal(signal.SIGTERM)
        returncode = await asyncio.to_thread(self.trainer.wait, 30)
        self.trainer_log.close()
        for rt in self.runtimes:
            await rt.close()
        await self.topology.delete(self.js)
        await self.nc.close()
        # nats-py leaves the checkers of closed ordered consumers pending: end them here.
        leftovers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)
        assert returncode == 0, self.trainer_tail()

    # What the streams hold ------------------------------------------------------------
    async def _observe(self, subject: str, cls: type[Event]) -> None:
        sub = await self.js.subscribe(subject, ordered_consumer=True)
        async for msg in sub.messages:
            try:
                event = decode(msg.data, cls)
            except DecodeError:
                continue
            if isinstance(event, Trajectories):  # a sample's event, or a whole group's
                self.seen.trajectories.update(t.id for t in event.each())
            elif isinstance(event, Rewards):
                self.seen.rewards.update((r.id, r) for r in event.each())
            elif isinstance(event, BatchEvent):
                self.seen.batches.append(event)
            elif isinstance(event, WeightVersionEvent):
                self.seen.weights.add(event.version)

    async def _observe_dead(self) -> None:
        sub = await self.js.subscribe(self.topology.subject(DEAD, ">"), ordered_consumer=True)
        async for msg in sub.messages:
            key, dead = as_dead(msg)
            self.seen.dead[key] = dead

    def assert_alive(self) -> None:
        """No worker stopped: every task still runs and the trainer process too."""
        stopped = {name: task for name, task in self.tasks.items() if task.done()}
        assert not stopped, {
            name: task.exception() for name, task in stopped.items() if not task.cancelled()
        }
        assert self.trainer.poll() is None, self.trainer_tail()

    def trainer_tail(self) -> str:
        self.trainer_log.flush()
        return (self.work / "trainer.log").read_text(errors="replace")[-3000:]

    async def until(self, predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        """Wait for `predicate`, failing early if a worker stops meanwhile."""
        deadline = time.monotonic() + timeout
        while not predicate():
            self.assert_alive()
            assert time.monotonic() < deadline, f"timed out waiting until {what}"
            await asyncio.sleep(0.05)

    # Poison and valid events ------------------------------------------------------------
    def subject(self, channel: Channel) -> str:
        """The subject of `channel` (rank 0's for batches)."""
        return (
            self.topology.subject(channel, 0) if channel.token else self.topology.subject(channel)
        )

    async def send(self, stream: str, data: bytes) -> Key:
        """Publish raw bytes (no message id: poison is not deduplicated) and return their key."""
        ack = await self.js.publish(self.subject(CHANNEL[stream]), data)
        return self.subject(CHANNEL[stream]), ack.seq

    async def dead_letters(self, keys: list[Key]) -> list[Dead]:
        """The dead letters of `keys`, once they are all there."""
        await self.until(
            lambda: all(key in self.seen.dead for key in keys), f"{len(keys)} messages are dead", 60
        )
        return [self.seen.dead[key] for key in keys]

    async def valid_prompt(self) -> None:
        """A prompt behind the poison: wait for its n trajectories."""
        index = next(self.counter)
        prompt = PromptEvent(
            id=f"{self.run}/0/{index}",
            run=self.run,
            epoch=0,
            index=index,
            token_ids=ids_tensor(tokens("c1234=")),
            task={"name": "digits", "rule": "copy", "target": "1234"},
            n=2,
            sampling=SamplingParams(max_tokens=MAX_TOKENS),
        )
        await self.js.publish(self.subject(PROMPTS), encode(prompt))
        expected = {f"{prompt.id}/{i}" for i in range(prompt.n)}
        await self.until(
            lambda: expected <= self.seen.trajectories, f"trajectories for {prompt.id}"
        )

    async def valid_trajectories(self) -> None:
        """Three trajectories behind the poison: scored, scored with an empty response, and
        failed by the reward function (its task has no target): wait for their rewards."""
        index = next(self.counter)
        cases = {
            "ok": ("12", {"target": "1234"}, 0.5, False),
            "empty": ("", {"target": "1234"}, 0.0, False),
            "no target": ("1", {}, 0.0, True),
        }
        sent = {}
        for name, (text, task, reward, failed) in cases.items():
            prompt_id = f"{self.run}/t{index}/{name.replace(' ', '-')}"
            response = tokens(text)
            t = scored(prompt_id, 0, 1, response, 0.0).trajectory
            t = t.model_copy(update={"response_text": text, "task": task})
            await self.js.publish(self.subject(TRAJECTORIES), encode(t))
            sent[t.id] = (reward, failed)
        await self.until(
            lambda: set(sent) <= set(self.seen.rewards), "rewards for the valid trajectories"
        )
        got = {i: (self.seen.rewards[i].reward, self.seen.rewards[i].failed) for i in sent}
        assert got == sent
        assert "KeyError" in next(
            self.seen.rewards[i].reason for i, (_, failed) in sent.items() if failed
        )

    async def group(self, responses: tuple[list[int], list[int]]) -> list[str]:
        """Publish a complete group of two scored samples (rewards 1 and 0); their ids."""
        prompt_id = f"{self.run}/g{next(self.counter)}"
        events = [
            scored(prompt_id, i, 2, response, 1.0 - i) for i, response in enumerate(responses)
        ]
        for event in events:
            await self.js.publish(self.subject(REWARDS), encode(event))
        return [event.id for event in events]

    async def valid_group(self) -> None:
        """A group behind the poison, one response empty: wait until a step trained it and the
        rollout serves the weights that step made."""
        ids = await self.group((tokens("1234") + [TOKEN["<eos>"]], []))
        await self.until(lambda: self.step_of(ids) is not None, "the valid group is batched")
        made = self.step_of(ids) + 1  # type: ignore[operator]
        await self.until(lambda: self.serving() >= made, f"the rollout serves v{made}", 60)
        assert self.serving() < FAR_VERSION  # no refused version was ever loaded

    def serving(self) -> int:
        """The weight version the rollout worker says it serves (its membership entry)."""
        return self.rollout_rt.member.member.weight_version or 0

    def step_of(self, sample_ids: list[str]) -> int | None:
        """The step of the batch holding `sample_ids`, once the buffer stored one."""
        return next(
            (b.step for b in self.seen.batches if set(sample_ids) <= set(b.sample_ids)), None
        )

    async def refused_by_trainer(self, sample_ids: list[str]) -> str:
        """The reason the trainer gave for the batch holding `sample_ids`, once it gave one."""

        def reason() -> str | None:
            for letter in self.seen.dead.values():
                if letter.stage == "trainer" and set(sample_ids) <= set(batch_ids(letter.data)):
                    return letter.reason
            return None

        await self.until(lambda: reason() is not None, "the trainer refuses the batch")
        return reason()  # type: ignore[return-value]

    async def valid_events(self, stream: str) -> None:
        """The valid events that follow poison in `stream`, with their outputs awaited."""
        if stream == "prompts":
            await self.valid_prompt()
        elif stream == "trajectories":
            await self.valid_trajectories()
        else:  # rewards, batches and weights: the valid group's batch, train step and weights
            await self.valid_group()


def batch_ids(data: bytes) -> tuple[str, ...]:
    """The sample ids of a batch, or none when `data` is not one."""
    try:
        return decode(data, BatchEvent).sample_ids
    except DecodeError:
        return ()


@pytest.fixture(scope="module")
def fleet(nats_server: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("poison")
    model_dir = build_tiny_model(work / "model", VOCAB)
    fleet = Fleet(
        nats_server.url, Topology(run=f"poison{int(time.time() * 1000) % 10**8}"), model_dir, work
    )
    fleet.start()
    yield fleet
    fleet.stop_all()


def check_dead(stream: str, keys: list[Key], dead: list[Dead]) -> None:
    """Each poison message is a dead letter of the stage that reads `stream`, with a reason,
    and was known for poison at once: never retried until the delivery limit."""
    for key, letter in zip(keys, dead, strict=False):
        assert letter.stage == READER[stream] and letter.reason, (key, letter.stage, letter.reason)
        assert not letter.reason.startswith(("failed ", "gave up")), (key, letter.reason)


@pytest.mark.timeout(300)
def test_one_of_each_kind_in_every_stream_goes_dead_and_valid_events_flow(fleet: Fleet) -> None:
    """Garbage, truncated msgpack, the wrong shape, an unknown type, a future version, a
    message at the max payload, NaN and negative values in each array; weights that decode
    but must not load; then the valid events of every stream."""
    for stream in STREAMS:
        poison = one_of_each_kind(GOLDEN_NAME[stream], MAX_PAYLOAD)
        if stream == "weights":
            poison += fleet.refused_weights
        keys = [fleet.call(fleet.send(stream, data)) for data in poison]
        dead = fleet.call(fleet.dead_letters(keys))
        check_dead(stream, keys, dead)
        oversize = next(d for d in dead if d.original_size is not None)
        assert (
            oversize.original_size == MAX_PAYLOAD
            and len(oversize.data) == MAX_PAYLOAD - HEADERS_ROOM
        )
        if stream == "weights":
            reasons = [d.reason for d in dead[-len(fleet.refused_weights) :]]
            assert all(r.startswith("weights refused:") for r in reasons), reasons
        fleet.call(fleet.valid_events(stream))
    assert fleet.serving() < FAR_VERSION
    fleet.assert_alive()


def refused_prompts() -> st.SearchStrategy[bytes]:
    """Prompts that decode but this model can never generate from."""

    def prompt(**fields: Any) -> bytes:
        return encode(
            PromptEvent(
                id="p/0/0",
                run="p",
                epoch=0,
                index=0,
                n=2,
                sampling=SamplingParams(max_tokens=MAX_TOKENS),
                **fields,
            )
        )

    in_vocab = st.integers(0, VOCAB_SIZE - 1)
    past_vocab = st.tuples(st.lists(in_vocab, max_size=6), st.integers(VOCAB_SIZE, 2**31 - 1)).map(
        lambda pair: [*pair[0], pair[1]]
    )
    too_long = st.integers(CONTEXT - MAX_TOKENS + 1, 4 * CONTEXT).map(lambda n: [TOKEN["1"]] * n)
    return st.one_of(
        st.one_of(past_vocab, too_long).map(lambda ids: prompt(token_ids=ids_tensor(ids))),
        st.text(alphabet=" xyzXYZ!?", max_size=8).map(
            lambda text: prompt(prompt=text)
        ),  # no token of the vocabulary
        st.just(
            prompt(messages=({"role": "user", "content": "c1234="},))
        ),  # the tokenizer has no chat template
    )


def refused_rewards(held_group: str) -> st.SearchStrategy[bytes]:
    """Rewards that decode but the buffer can never batch: made by weights no trainer has made
    yet, or claiming another size for a group the buffer holds."""

    def future(version: int) -> bytes:
        event = scored("r/g", 0, 2, [1], 1.0)
        later = event.trajectory.model_copy(update={"versions": ids_tensor([version])})
        return encode(event.model_copy(update={"trajectory": later}))

    return st.one_of(
        st.integers(10**4, 2**31 - 1).map(future),
        st.integers(3, 1024).map(lambda size: encode(scored(held_group, size - 1, size, [1], 1.0))),
    )


def other_step_batches() -> st.SearchStrategy[bytes]:
    """Batches that decode but are for a step the trainer is not at (the golden one, moved)."""
    batch = golden()["batch.v1"]
    return st.integers(10**4, 2**31 - 1).map(
        lambda step: encode(batch.model_copy(update={"step": step}))
    )


def poison_for(stream: str, fleet: Fleet) -> st.SearchStrategy[bytes]:
    """Hypothesis-made poison for `stream`: mutated golden events that do not decode, and
    events that decode but the stage that reads the stream must refuse."""
    event_type = EVENT[stream]
    assert event_type is not None  # the streams poisoned here carry events
    broken = undecodable(GOLDEN_NAME[stream], event_type)
    refused = {
        "prompts": refused_prompts(),
        "trajectories": broken,
        "rewards": refused_rewards(fleet.held_group),
        "batches": other_step_batches(),
        "weights": st.sampled_from(fleet.refused_weights),
    }[stream]
    return st.one_of(broken, refused)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", STREAMS)
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hypothesis_poison_goes_dead_and_valid_events_flow(
    fleet: Fleet, stream: str, data: st.DataObject
) -> None:
    poison = data.draw(st.lists(poison_for(stream, fleet), min_size=2, max_size=4), label="poison")
    keys = [fleet.call(fleet.send(stream, message)) for message in poison]
    check_dead(stream, keys, fleet.call(fleet.dead_letters(keys)))
    fleet.call(fleet.valid_events(stream))
    fleet.assert_alive()


@pytest.mark.timeout(300)
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    response=st.one_of(
        st.integers(VOCAB_SIZE, 2**31 - 1).map(lambda token: [TOKEN["1"], token]),
        st.integers(CONTEXT, 2 * CONTEXT).map(lambda n: [TOKEN["1"]] * n),
    )
)
def test_ids_or_lengths_the_model_cannot_take_are_refused_by_the_trainer(
    fleet: Fleet, response: list[int]
) -> None:
    """A response with a token id past the vocabulary, or too long for the context, decodes
    and is batched (the buffer holds no model); the trainer refuses the micro-batch holding it,
    with the reason, and counts it toward its step, so the next valid group still trains."""
    ids = fleet.call(fleet.group((response, [])))
    reason = fleet.call(fleet.refused_by_trainer(ids))
    assert "outside the model's vocabulary" in reason or "the model's context is" in reason, reason
    fleet.call(fleet.valid_group())
    fleet.assert_alive()


# --- the reference stage's streams ------------------------------------------------------


async def _until(
    check: Callable[[], Awaitable[bool]],
    what: str,
    tasks: list[asyncio.Task[Any]],
    timeout: float = 60,
) -> None:
    """Wait for `check`, failing at once if a stage stopped meanwhile."""
    deadline = time.monotonic() + timeout
    while not await check():
        stopped = [t for t in tasks if t.done()]
        assert not stopped, [t.exception() for t in stopped if not t.cancelled()]
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.1)


@pytest.mark.timeout(300)
def test_reference_stage_poison(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    """Poison into `rewards` goes dead under the reference stage, into `scored` under the buffer,
    with a reason and at once (never retried to the limit); so do samples each must refuse: ids
    past the vocabulary or longer than the context (reference), a sample with no reference
    log-probs or ref_logprobs that are not log-probs (buffer). Then a valid group is scored,
    batched with its reference log-probs and its KL coefficient, and no stage stopped."""
    run = f"refpoison{int(time.time() * 1000) % 10**8}"
    model_dir = build_tiny_model(tmp_path / "model", VOCAB)
    config = RunConfig.model_validate(
        {
            "run": run,
            "model": {"path": str(model_dir)},
            "data": {"n": 2, "sampling": {"max_tokens": MAX_TOKENS}},
            "algorithm": {
                "prompts_per_step": 1,
                "max_staleness": 10**6,
                "kl_coef": 0.1,
                "kl_placement": "reward",
            },
            "trainer": {"steps": 10**6},
            "reference": {"enabled": True, "batch": 2},
        }
    )
    topology = Topology.for_config(config)

    def refused_by_reference() -> list[bytes]:
        past_vocab = scored(f"{run}/v", 0, 2, [TOKEN["1"], VOCAB_SIZE + 5], 1.0)
        too_long = scored(f"{run}/l", 0, 2, [TOKEN["1"]] * CONTEXT, 1.0)
        return [encode(past_vocab), encode(too_long)]

    def refused_by_buffer() -> list[bytes]:
        bare = scored(f"{run}/b", 0, 2, [TOKEN["1"]], 1.0)  # never passed the reference stage
        fields = msgpack.unpackb(encode(bare))
        positive = {
            **fields,
            "ref_logprobs": {
                "dtype": "float32",
                "shape": [1],
                "data": np.array([0.5], dtype=np.float32).tobytes(),
            },
        }
        short = {
            **fields,
            "ref_logprobs": {
                "dtype": "float32",
                "shape": [2],
                "data": np.array([-1, -1], dtype=np.float32).tobytes(),
            },
        }
        return [
            encode(bare),
            msgpack.packb(positive, use_bin_type=True),
            msgpack.packb(short, use_bin_type=True),
        ]

    async def scenario() -> tuple[dict[str, list[Dead]], BatchEvent]:
        nc = await connect(nats_server.url, "test-reference-poison")
        js = nc.jetstream()
        await topology.apply(js)
        await publish_config(await js.key_value(topology.kv_bucket), config)
        stop, tasks, stages, runtimes = asyncio.Event(), [], [], []
        for role, build in (("reference", reference_stage.build), ("buffer", buffer_stage.build)):
            rt = await attach(role, run, nats_server.url)
            stage = await build(rt)
            runtimes.append(rt)
            stages.append(stage)
            tasks.append(asyncio.create_task(serve(rt, stage, stop)))
        try:
            dead: dict[str, list[Dead]] = {}
            for channel, refused in (
                (REWARDS, refused_by_reference()),
                (SCORED, refused_by_buffer()),
            ):
                poison = one_of_each_kind("reward.v1", MAX_PAYLOAD) + refused
                keys = [
                    (
                        topology.subject(channel),
                        (await js.publish(topology.subject(channel), data)).seq,
                    )
                    for data in poison
                ]
                found: dict[Key, Dead] = {}

                async def all_dead(keys: list[Key] = keys, found: dict[Key, Dead] = found) -> bool:
                    found.update(await dead_letters(js, topology))
                    return all(key in found for key in keys)

                await _until(all_dead, f"the poison in {channel.name} is dead", tasks)
                dead[channel.name] = [found[key] for key in keys]
            group = [
                scored(f"{run}/good", i, 2, [TOKEN["1"], TOKEN["2"]][: 2 - i], 1.0 - i)
                for i in range(2)
            ]
            for event in group:
                await js.publish(topology.subject(REWARDS), encode(event))

            async def batched() -> bool:
                return (await js.stream_info(topology.stream(BATCHES))).state.messages > 0

            await _until(batched, "the valid group is batched", tasks)
            sub = await js.subscribe(topology.subjects(BATCHES), ordered_consumer=True)
            batch = decode((await sub.next_msg(timeout=10)).data, BatchEvent)
            await sub.unsubscribe()
            assert not [t for t in tasks if t.done()], "a stage stopped"
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            for stage in stages:
                if stage.close is not None:
                    await stage.close()
            for rt in runtimes:
                await rt.close()
            await topology.delete(js)
            await nc.close()
        return dead, batch

    dead, batch = asyncio.run(scenario())
    for stream, stage in (("rewards", "reference"), ("scored", "buffer")):
        for letter in dead[stream]:
            assert letter.stage == stage and letter.reason, (stream, letter.stage, letter.reason)
            assert not letter.reason.startswith(("failed ", "gave up")), (stream, letter.reason)
    reasons = [d.reason for d in dead["rewards"][-2:]] + [d.reason for d in dead["scored"][-3:]]
    assert (
        "outside the model's vocabulary" in reasons[0] and "the model's context is" in reasons[1]
    ), reasons
    assert "no reference log-probs" in reasons[2], reasons
    assert "ref_logprobs" in reasons[3] and "ref_logprobs" in reasons[4], reasons
    assert set(batch.sample_ids) == {f"{run}/good/0", f"{run}/good/1"}
    assert batch.ref_logprobs is not None and batch.kl_coef == pytest.approx(0.1)
    ref, loss = batch.ref_logprobs.numpy(), batch.loss_mask.numpy() == 1
    assert (ref[loss] < 0).all() and (ref[~loss] == 0).all()
