"""Driving a real buffer process from a test: scored samples in, its batch stream and consumer out.

The buffer is started as `python -m consumers.buffer --run R --nats URL`, exactly as a fleet
starts it, so what is checked is the process's behaviour (its config from KV, its work queue,
its crash points), not a test double of it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import numpy as np
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo
from nats.js.errors import KeyNotFoundError

from bus.connection import connect
from bus.crashpoints import CRASH_AT, CRASH_RECORD, arm
from bus.publisher import Publisher
from bus.runtime import publish_config
from bus.topology import BATCHES, REWARDS, Topology, drop_key
from schemas import (
    BatchEvent,
    RewardEvent,
    RewardGroupEvent,
    Tensor,
    TrajectoryEvent,
    decode,
    group_id,
)
from schemas.config import RunConfig
from schemas.kv_records import DropRecord

ROOT = Path(__file__).resolve().parent.parent
SETTLE = 60.0
"""Seconds a buffer test waits for something to happen: start-up (imports, attach) takes seconds,
more on a busy machine."""
PROMPT_TOKENS = 5


def scored(
    run: str,
    prompt: str,
    sample: int,
    reward: float,
    group: int,
    response_tokens: int = 8,
    version: int = 0,
) -> RewardEvent:
    """One scored sample of group `prompt` (a prompt id of `run`), made by weights `version`."""
    t = TrajectoryEvent(
        id=f"{prompt}/{sample}",
        run=run,
        prompt_id=prompt,
        sample_index=sample,
        group_size=group,
        prompt_ids=Tensor.from_numpy(np.arange(PROMPT_TOKENS, dtype=np.int32)),
        response_ids=Tensor.from_numpy(np.arange(response_tokens, dtype=np.int32)),
        logprobs=Tensor.from_numpy(np.full(response_tokens, -1.0, np.float32)),
        versions=Tensor.from_numpy(np.full(response_tokens, version, np.int32)),
    )
    return RewardEvent(id=t.id, run=run, trajectory=t, reward=reward)


def group(
    run: str, index: int, rewards: Iterable[float], response_tokens: int = 8, version: int = 0
) -> list[RewardEvent]:
    """Every sample of group `index` of `run`, sample i scored rewards[i], by weights `version`."""
    values = list(rewards)
    prompt = f"{run}/0/{index}"
    size = len(values)
    return [scored(run, prompt, i, r, size, response_tokens, version) for i, r in enumerate(values)]


def expected_advantages(estimator: str, rewards: Iterable[float]) -> np.ndarray:
    """The estimator's advantages, written out again here (float64) to check the buffer's."""
    r = np.asarray(list(rewards), np.float64)
    centred = r - r.mean()
    if estimator == "grpo":
        return centred / (r.std(ddof=1) + 1e-6)
    if estimator == "dr_grpo":
        return centred
    if estimator == "rloo":
        return np.array([r[i] - np.delete(r, i).mean() for i in range(len(r))])
    if (
        estimator == "gae"
    ):  # the trainer's critic forms token advantages from the rewards themselves
        return r
    raise ValueError(estimator)


async def declare(
    js: JetStreamContext, topology: Topology, config: RunConfig, ack_wait: float | None = None
) -> None:
    """Declare the run and put `config` in KV, as a producer would; with `ack_wait`, the buffer's
    work queue is declared with it (before any buffer reads it), so that held or orphaned
    samples come back within a test's time."""
    await topology.apply(js)
    if ack_wait is not None:
        await js.add_consumer(
            topology.stream(REWARDS),
            topology.consumer_config(REWARDS.with_queue(ack_wait=ack_wait)),
        )
    await publish_config(await js.key_value(topology.kv_bucket), config)


async def publish(
    js: JetStreamContext,
    topology: Topology,
    rewards: Iterable[RewardEvent],
    grouped: bool = False,
) -> None:
    """Store `rewards` in the rewards stream, in order, as the reward workers would: each its
    own event, or with `grouped` each whole group (consecutive, in sample order) as one."""
    publisher = Publisher(js, topology)
    for event in as_groups(list(rewards)) if grouped else rewards:
        await publisher.publish(REWARDS, event)


def as_groups(rewards: list[RewardEvent]) -> list[RewardGroupEvent]:
    """Consecutive whole groups of `rewards` (each in sample order) as one event each."""
    out, start = [], 0
    while start < len(rewards):
        first = rewards[start].trajectory
        members = rewards[start : start + first.group_size]
        out.append(
            RewardGroupEvent(
                id=group_id(first.prompt_id),
                run=first.run,
                prompt_id=first.prompt_id,
                rewards=tuple(members),
            )
        )
        start += first.group_size
    return out


def start_buffer(
    url: str, topology: Topology, log: Path, crash_at: str | None = None
) -> subprocess.Popen[bytes]:
    """The buffer as a process, its output appended to `log`; `crash_at` arms a crash point."""
    env = {k: v for k, v in os.environ.items() if k not in (CRASH_AT, CRASH_RECORD)}
    if crash_at is not None:
        env[CRASH_AT] = arm(crash_at)
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "consumers.buffer", "--run", topology.run, "--nats", url],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def stop_buffer(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM (the buffer drains and exits 0), SIGKILL if it hangs; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def tail(log: Path, lines: int = 15) -> str:
    return (
        "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        if log.exists()
        else "(no log)"
    )


async def batches(js: JetStreamContext, topology: Topology) -> list[BatchEvent]:
    """Every BatchEvent stored so far, in stream order."""
    count = (await js.stream_info(topology.stream(BATCHES))).state.messages
    if not count:
        return []
    sub = await js.subscribe(topology.subject(BATCHES, ">"), ordered_consumer=True)
    try:
        return [decode((await sub.next_msg(timeout=5)).data, BatchEvent) for _ in range(count)]
    finally:
        await sub.unsubscribe()


async def buffer_consumer(js: JetStreamContext, topology: Topology) -> ConsumerInfo:
    """The server's view of the buffer's work queue on the rewards stream."""
    return await js.consumer_info(topology.stream(REWARDS), REWARDS.work_queue.durable)


async def drained(js: JetStreamContext, topology: Topology) -> bool:
    """Whether every reward has been delivered to the buffer and acked by it."""
    info = await buffer_consumer(js, topology)
    return info.num_pending == 0 and info.num_ack_pending == 0


async def drop_record(js: JetStreamContext, topology: Topology, prompt: str) -> str | None:
    """The reason the buffer recorded for dropping group `prompt`, or None."""
    try:
        entry = await (await js.key_value(topology.kv_bucket)).get(drop_key(prompt))
    except KeyNotFoundError:
        return None
    return DropRecord.decode(entry.value).reason


async def until(
    check: Callable[[], Awaitable[bool]], timeout: float, what: Callable[[], Awaitable[str]]
) -> None:
    """Poll `check` until it holds; past `timeout` s fail the test saying `await what()`."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(await what())
        await asyncio.sleep(0.1)


def run_with_js(url: str, body: Callable[[JetStreamContext], Awaitable[None]]) -> None:
    """Run `body` on a fresh event loop with a JetStream context of the server at `url`."""

    async def main() -> None:
        nc = await connect(url, "test-buffer")
        try:
            await body(nc.jetstream())
        finally:
            await nc.close()

    asyncio.run(main())


def by_step(stored: list[BatchEvent]) -> dict[int, list[BatchEvent]]:
    steps: dict[int, list[BatchEvent]] = defaultdict(list)
    for batch in stored:
        steps[batch.step].append(batch)
    return dict(steps)


def summary(stored: list[BatchEvent]) -> str:
    """One line per step: its micro-batches stored / expected and the groups it names."""
    lines = []
    for step, events in sorted(by_step(stored).items()):
        names = sorted({p for b in events for p in b.step_prompt_ids})
        lines.append(
            f"step {step}: {len(events)}/{events[0].micro_count} micro-batches, groups {names}"
        )
    return "; ".join(lines) or "no batches"


def check_steps(
    stored: list[BatchEvent], groups: dict[str, list[str]]
) -> dict[int, tuple[str, ...]]:
    """Assert the batch stream is whole: each step has all its micro-batches, once each, all
    naming the same groups; a step's samples are exactly the samples of those groups; no
    sample is in two batches. `groups`: prompt id -> its sample ids. Returns step -> groups."""
    seen: dict[str, str] = {}
    for batch in stored:
        for sid in batch.sample_ids:
            assert sid not in seen, f"sample {sid} is in two batches: {seen[sid]} and {batch.id}"
            seen[sid] = batch.id
    named: dict[int, tuple[str, ...]] = {}
    for step, events in sorted(by_step(stored).items()):
        indices = sorted(b.micro_index for b in events)
        assert indices == list(range(events[0].micro_count)), (
            f"step {step} has micro-batches {indices} of {events[0].micro_count}: {summary(stored)}"
        )
        names = {b.step_prompt_ids for b in events}
        assert len(names) == 1, (
            f"the micro-batches of step {step} name different groups: {sorted(names)}"
        )
        named[step] = names.pop()
        want = sorted(sid for p in named[step] for sid in groups[p])
        got = sorted(sid for b in events for sid in b.sample_ids)
        assert got == want, (
            f"step {step} names groups {named[step]} but holds samples {got}, not {want}"
        )
    return named
