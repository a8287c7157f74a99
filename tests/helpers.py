"""Small builders shared by tests."""

from __future__ import annotations

import asyncio
import importlib
import os
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest
from nats.js import JetStreamContext

from bus.connection import connect
from bus.dead import REASON
from bus.topology import DEAD, Channel, Topology
from consumers.membership import Member, live_members
from consumers.runtime import publish_config

from schemas import PromptEvent, RewardEvent, Tensor, TrajectoryEvent, WeightVersionEvent
from schemas.config import RunConfig


def trajectory(run: str, prompt: int = 0, sample: int = 0, tokens: int = 8, group: int = 4) -> TrajectoryEvent:
    return TrajectoryEvent(
        id=f"{run}/0/{prompt}/{sample}",
        run=run,
        prompt_id=f"{run}/0/{prompt}",
        sample_index=sample,
        group_size=group,
        prompt_ids=Tensor.from_numpy(np.arange(5, dtype=np.int32)),
        response_ids=Tensor.from_numpy(np.arange(tokens, dtype=np.int32)),
        logprobs=Tensor.from_numpy(np.full(tokens, -1.5, dtype=np.float32)),
        versions=Tensor.from_numpy(np.zeros(tokens, dtype=np.int32)),
        response_text="1 2 3",
        task={"answer": "1 2 3"},
    )


def prompt(run: str, index: int, epoch: int = 0) -> PromptEvent:
    return PromptEvent(id=f"{run}/{epoch}/{index}", run=run, epoch=epoch, index=index, prompt=f"p{index}", n=2)


def reward(run: str, prompt_index: int = 0, sample: int = 0, value: float = 1.0) -> RewardEvent:
    t = trajectory(run, prompt_index, sample)
    return RewardEvent(id=t.id, run=run, trajectory=t, reward=value)


async def messages(js: JetStreamContext, topology: Topology, channel: Channel) -> int:
    return (await js.stream_info(topology.stream(channel))).state.messages


async def dead_letters(js: JetStreamContext, topology: Topology) -> list[tuple[bytes, str]]:
    sub = await js.subscribe(topology.subject(DEAD, ">"), ordered_consumer=True)
    out = []
    for _ in range(await messages(js, topology, DEAD)):
        msg = await sub.next_msg(timeout=5)
        out.append((msg.data, (msg.headers or {})[REASON]))
    await sub.unsubscribe()
    return out


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll `predicate` until it holds; fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def declare_run(url: str, topology: Topology) -> None:
    """Declare a run's streams and buckets and put a default config in KV, as a producer would."""

    async def declare() -> None:
        nc = await connect(url, "test-declare")
        try:
            await topology.apply(nc.jetstream())
            await publish_config(await nc.jetstream().key_value(topology.kv_bucket), RunConfig(run=topology.run))
        finally:
            await nc.close()

    asyncio.run(declare())


def members(url: str, topology: Topology) -> list[Member]:
    """The run's live members, as `live_members` reads them."""

    async def read() -> list[Member]:
        nc = await connect(url, "test-members")
        try:
            return await live_members(nc.jetstream(), topology)
        finally:
            await nc.close()

    return asyncio.run(read())


def require_extra(module: str, extra: str) -> ModuleType:
    """`module`, from an optional extra: skipped where it is not installed, but a failure in CI
    (CI=true), which installs the `dev` extras, so that their tests cannot quietly stop running."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is the optional [{extra}] extra: pip install -e '.[{extra}]'")


async def store_weights(
    js: JetStreamContext, topology: Topology, version: int, tensors: dict, source: str = "test"
) -> WeightVersionEvent:
    """Store `tensors` as `version` in the run's object store, as the trainer does; the
    `WeightVersionEvent` that announces them (not published)."""
    # Imported here: torch takes seconds, and most tests that use these helpers never need it.
    from consumers.weights.object_store import ObjectStoreTransport
    from consumers.weights.transport import publish_version

    transport = ObjectStoreTransport(js, topology.object_bucket)  # type: ignore[arg-type]
    return await publish_version(transport, topology.run, source, version, tensors)
