"""Small builders shared by tests."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import yaml
from nats.js import JetStreamContext

from bus.connection import connect
from bus.dead import REASON
from bus.membership import Member, live_members
from bus.runtime import publish_config
from bus.topology import DEAD, TRAJECTORIES, Channel, Topology
from schemas import (
    PromptEvent,
    RewardEvent,
    Rewards,
    Tensor,
    Trajectories,
    TrajectoryEvent,
    WeightVersionEvent,
    decode,
)
from schemas.config import RunConfig

ROOT = Path(__file__).resolve().parent.parent


def trajectory(
    run: str, prompt: int = 0, sample: int = 0, tokens: int = 8, group: int = 4
) -> TrajectoryEvent:
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
    return PromptEvent(
        id=f"{run}/{epoch}/{index}", run=run, epoch=epoch, index=index, prompt=f"p{index}", n=2
    )


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
            await publish_config(
                await nc.jetstream().key_value(topology.kv_bucket), RunConfig(run=topology.run)
            )
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
    return pytest.importorskip(
        module, reason=f"{module} is the optional [{extra}] extra: pip install -e '.[{extra}]'"
    )


async def store_weights(
    js: JetStreamContext, topology: Topology, version: int, tensors: dict, source: str = "test"
) -> WeightVersionEvent:
    """Store `tensors` as `version` in the run's object store, as the trainer does; the
    `WeightVersionEvent` that announces them (not published)."""
    # Imported here: torch takes seconds, and most tests that use these helpers never need it.
    from consumers.weights.object_store import ObjectStoreTransport
    from consumers.weights.sender import publish_version

    transport = ObjectStoreTransport(js, topology.object_bucket)  # type: ignore[arg-type]
    return await publish_version(transport, topology.run, source, version, tensors)


@dataclass(frozen=True)
class LocalJob:
    """What a local job that ran to its end left behind."""

    out: Path
    """Its `--out` directory."""
    summary: dict[str, Any]
    """The summary it printed last (steps, samples trained, ...)."""
    logs: dict[str, str]
    """Each worker's log, by file name (`trainer-0.log`, `trainer-rank1-0.log`,
    `rollout-0.log`, ...)."""

    def merged_metrics(self) -> list[dict[str, Any]]:
        """Each step's metrics as the producer merged them (`metrics.jsonl`)."""
        return [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines()]

    def losses(self, log: str) -> list[str]:
        """The loss of each step, as the trainer log `log` prints it."""
        return [
            line.rsplit("loss ", 1)[1]
            for line in self.logs[log].splitlines()
            if ": reward " in line
        ]

    def rollout_log(self) -> str:
        """Every rollout worker's log, one after another."""
        return "".join(text for name, text in self.logs.items() if name.startswith("rollout"))

    def served_versions(self) -> list[int]:
        """The weight versions the rollout workers said they serve, in the order they said it."""
        return served_versions(self.rollout_log())


def served_versions(log: str) -> list[int]:
    """The versions of each "now serving weights vN (k of n tensors loaded)" line in `log`."""
    return [
        int(line.rsplit("weights v", 1)[1].split()[0])
        for line in log.splitlines()
        if "now serving weights v" in line
    ]


def run_local_job(
    config: dict[str, Any],
    tmp_path: Path,
    steps: int,
    timeout: float,
    env: dict[str, str] | None = None,
) -> LocalJob:
    """`python -m producers.prompts --config <config> --steps <steps> --out <tmp_path>/run`: the
    whole local job (embedded server, a fleet of every role) run to its end; fails the test with
    its stderr and the tail of each worker's log when it exits with an error."""
    path, out = tmp_path / "job.yaml", tmp_path / "run"
    path.write_text(yaml.safe_dump(config))
    job = subprocess.run(
        [
            sys.executable,
            "-m",
            "producers.prompts",
            "--config",
            str(path),
            "--steps",
            str(steps),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    logs = (
        {p.name: p.read_text() for p in (out / "logs").glob("*.log")}
        if (out / "logs").exists()
        else {}
    )
    assert job.returncode == 0, job.stderr[-2000:] + "".join(text[-1500:] for text in logs.values())
    return LocalJob(out, json.loads(job.stdout.strip().splitlines()[-1]), logs)


async def stored_trajectories(
    js: JetStreamContext, topology: Topology, count: int, timeout: float = 60.0
) -> list[TrajectoryEvent]:
    """The samples of the trajectories stream's events (a group's event holds n), once it holds
    at least `count` (AssertionError after `timeout` s)."""
    deadline = time.monotonic() + timeout
    while len(stored := await stream_samples(js, topology, TRAJECTORIES)) < count:
        assert time.monotonic() < deadline, f"{len(stored)} of {count} trajectories stored"
        await asyncio.sleep(0.1)
    return [t for t in stored if isinstance(t, TrajectoryEvent)]


async def stream_samples(
    js: JetStreamContext, topology: Topology, channel: Channel[Trajectories] | Channel[Rewards]
) -> list[TrajectoryEvent | RewardEvent]:
    """Every sample `channel`'s stream holds now, in stored order: a sample's own event, or each
    of a group's (`schemas.group_events`)."""
    stored = (await js.stream_info(topology.stream(channel))).state.messages
    if stored == 0:
        return []
    sub = await js.subscribe(topology.subject(channel), ordered_consumer=True)
    try:
        events: list[Trajectories | Rewards] = [
            decode((await sub.next_msg(timeout=5)).data, channel.event)  # type: ignore[arg-type,misc]
            for _ in range(stored)
        ]
    finally:
        await sub.unsubscribe()
    return [one for event in events for one in event.each()]
