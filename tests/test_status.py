"""`ops.status` against a real run: the figures it prints are the ones the streams,
consumers and KV hold."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from nats.aio.client import Client
from nats.aio.msg import Msg

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.membership import Membership, live_members
from bus.publisher import Publisher
from bus.runtime import publish_config
from bus.topology import (
    BATCHES,
    DEAD,
    PROMPTS,
    REWARDS,
    SCORED,
    TRAJECTORIES,
    WEIGHTS,
    Topology,
)
from ops.status import details, render, sample
from schemas import BatchEvent, Tensor, WeightVersionEvent
from schemas.config import RunConfig
from tests.helpers import prompt, reward, trajectory

ROOT = Path(__file__).resolve().parent.parent


def table(page: str, header: str) -> dict[str, list[str]]:
    """The rows of the table under the line starting with `header`, by their first column."""
    lines = page.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header)) + 1
    rows = {}
    for line in lines[start:]:
        if not line.strip():
            break
        rows[line.split()[0]] = line.split()[1:]
    return rows


def batch(run: str, step: int, versions: list[list[int]], loss_mask: list[list[int]]) -> BatchEvent:
    """A micro-batch of len(versions) rows whose only meaningful figures are versions and loss
    mask."""
    rows, tokens = np.shape(versions)
    zeros = np.zeros((rows, tokens), np.float32)
    return BatchEvent(
        id=f"{run}/step/{step}/0/0",
        run=run,
        step=step,
        dp_rank=0,
        dp_size=1,
        micro_index=0,
        micro_count=1,
        input_ids=Tensor.from_numpy(np.zeros((rows, tokens), np.int32)),
        attention_mask=Tensor.from_numpy(np.ones((rows, tokens), np.uint8)),
        loss_mask=Tensor.from_numpy(np.array(loss_mask, np.uint8)),
        advantages=Tensor.from_numpy(np.zeros(rows, np.float32)),
        behaviour_logprobs=Tensor.from_numpy(zeros),
        versions=Tensor.from_numpy(np.array(versions, np.int32)),
        rewards=Tensor.from_numpy(np.zeros(rows, np.float32)),
        sample_ids=tuple(f"{run}/0/{i}/0" for i in range(rows)),
    )


async def populate(nc: Client, topology: Topology) -> list[Msg]:
    """A run mid-flight; returns the two prompts left in flight (one of them redelivered)."""
    js = nc.jetstream()
    await topology.apply(js)
    await publish_config(await js.key_value(topology.kv_bucket), RunConfig(run=topology.run))
    publisher = Publisher(js, topology)
    run = topology.run
    for i in range(5):
        await publisher.publish(PROMPTS, prompt(run, i))
    for i in range(3):
        await publisher.publish(TRAJECTORIES, trajectory(run, prompt=i))
    for i in range(2):
        await publisher.publish(REWARDS, reward(run, prompt_index=i))
    # Staleness at step 3 over the loss tokens: 0, 0, 1 | 2, 0.
    stale = batch(
        run, 3, versions=[[-1, 3, 3, 2], [-1, -1, 1, 3]], loss_mask=[[0, 1, 1, 1], [0, 0, 1, 1]]
    )
    await publisher.publish(BATCHES, stale, 0)
    await js.publish(topology.subject(BATCHES, 0), b"not a batch")
    weights = WeightVersionEvent(
        id=f"{run}/weights/3", run=run, version=3, step=3, location="w", manifest=(), total_bytes=0
    )
    await publisher.publish(WEIGHTS, weights)
    for stage in ("reward", "reward", "rollout"):
        await js.publish(topology.subject(DEAD, stage), b"x")
    sub = await js.pull_subscribe_bind(PROMPTS.work_queue.durable, stream=topology.stream(PROMPTS))
    taken = await sub.fetch(2, timeout=5)
    # A nak sent as a request: the server answers once it has processed it, so the next
    # fetch gets this message again rather than racing ahead to a fresh one.
    await nc.request(taken[0].reply, b"-NAK", timeout=5)
    return [*taken[1:], *(await sub.fetch(1, timeout=5))]


def test_status_prints_the_run_as_the_bus_holds_it(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def scenario() -> str:
        nc = await connect(nats_server.url, "test")
        js = nc.jetstream()
        await populate(nc, topology)
        rollout = await Membership.join(js, topology, "rollout")
        trainer = await Membership.join(js, topology, "trainer")
        rollout.report(engine="hf", weight_version=3)
        trainer.report(engine="torch", weight_version=4)
        while {m.weight_version for m in await live_members(js, topology)} != {3, 4}:
            await asyncio.sleep(0.05)
        status = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "ops.status",
            "--run",
            topology.run,
            "--nats",
            nats_server.url,
            cwd=ROOT,
            stdout=subprocess.PIPE,
        )
        out, _ = await status.communicate()
        assert status.returncode == 0
        await rollout.leave()
        await trainer.leave()
        await nc.close()
        return out.decode()

    out = asyncio.run(scenario())
    stored = {stage: int(row[0]) for stage, row in table(out, "stage").items()}
    assert stored == {
        "prompts": 5,
        "trajectories": 3,
        "rewards": 2,
        "scored": 0,
        "batches": 2,
        "weights": 1,
        "dead": 3,
    }
    queues = table(out, "queue")  # stream read, pending, in flight, redelivered, done/s
    assert queues["rollout"][:4] == ["prompts", "3", "2", "1"]
    assert queues["reward"][:4] == ["trajectories", "3", "0", "0"]
    assert queues["buffer"][:4] == ["rewards", "2", "0", "0"]
    assert "dead letters: reward 2, rollout 1" in out
    assert "trainer at step 4; latest weights v3" in out
    assert (
        "staleness (step - version) over step 3, 5 loss tokens: 0: 60.0%  1: 20.0%  2: 20.0%" in out
    )
    assert "workers: 2 live" in out
    assert re.search(rf"^rollout +\S+ +{os.getpid()} +hf +v3 ", out, re.M)
    assert re.search(rf"^trainer +\S+ +{os.getpid()} +torch +step 4 ", out, re.M)


def test_rates_are_the_change_between_two_samples(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def scenario() -> tuple[str, str, str]:
        nc = await connect(nats_server.url, "test")
        js = nc.jetstream()
        in_flight = await populate(nc, topology)
        before = await sample(js, topology)
        for msg in in_flight:
            await msg.ack_sync()
        for i in range(5, 9):
            await Publisher(js, topology).publish(PROMPTS, prompt(topology.run, i))
        now = await sample(js, topology)
        page = render(topology, before, now, await details(js, topology, batches=16))
        await nc.close()
        seconds = now.time - before.time
        return page, f"{2 / seconds:.1f}", f"{4 / seconds:.1f}"

    page, done_rate, in_rate = asyncio.run(scenario())
    queues = table(page, "queue")
    assert queues["rollout"] == [
        "prompts",
        "7",
        "0",
        "0",
        done_rate,
    ]  # 2 acked; 4 new + 3 left pending
    assert queues["reward"][-1] == "0.0" and table(page, "stage")["prompts"][-1] == in_rate


def test_watch_redraws_and_a_missing_run_is_one_line(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def apply() -> None:
        nc = await connect(nats_server.url, "test")
        await topology.apply(nc.jetstream())
        await nc.close()

    asyncio.run(apply())
    watch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ops.status",
            "--run",
            topology.run,
            "--nats",
            nats_server.url,
            "--watch",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert watch.stdout is not None
    frames: list[list[str]] = []
    while len(frames) < 2 or not frames[-1][-1].startswith("workers:"):
        line = watch.stdout.readline()
        assert line, "ops.status --watch stopped drawing"
        if line.startswith("\033[H\033[J"):  # clear screen: a new frame
            frames.append([])
        frames[-1].append(line)
    watch.send_signal(signal.SIGINT)
    assert watch.wait(timeout=10) == 0
    assert (
        "staleness: no batches yet\n" in frames[1]
        and "no live trainer; latest weights none yet\n" in frames[1]
    )

    url = nats_server.url
    missing = subprocess.run(
        [sys.executable, "-m", "ops.status", "--run", "nosuchrun", "--nats", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert missing.returncode == 1
    assert (
        missing.stderr.strip()
        == f"ops.status: run nosuchrun has no streams on {url}; is the run id right?"
    )


def test_a_run_with_the_reference_stage_shows_its_queues(nats_server: EmbeddedNats) -> None:
    """With `reference.enabled` the stored config decides the queues: the reference stage reads
    `rewards`, the buffer `scored`; a live reference worker is listed."""
    config = RunConfig.model_validate(
        {"run": f"statusref{os.getpid()}", "reference": {"enabled": True}}
    )
    topology = Topology.for_config(config)

    async def scenario() -> str:
        nc = await connect(nats_server.url, "test")
        js = nc.jetstream()
        await topology.apply(js)
        await publish_config(await js.key_value(topology.kv_bucket), config)
        publisher = Publisher(js, topology)
        for i in range(3):
            await publisher.publish(REWARDS, reward(topology.run, prompt_index=i))
        await publisher.publish(SCORED, reward(topology.run, prompt_index=0))
        member = await Membership.join(js, topology, "reference")
        member.report(engine="reference")
        status = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "ops.status",
            "--run",
            topology.run,
            "--nats",
            nats_server.url,
            cwd=ROOT,
            stdout=subprocess.PIPE,
        )
        out, _ = await status.communicate()
        assert status.returncode == 0
        await member.leave()
        await topology.delete(js)
        await nc.close()
        return out.decode()

    out = asyncio.run(scenario())
    queues = table(out, "queue")
    assert queues["reference"][:2] == ["rewards", "3"] and queues["buffer"][:2] == [
        "scored",
        "1",
    ], out
    assert {stage: int(row[0]) for stage, row in table(out, "stage").items()}["scored"] == 1
    assert re.search(rf"^reference +\S+ +{os.getpid()} +reference ", out, re.M), out
