"""A stalled run names who holds its work: each stall provoked on a real server (real worker
processes where it matters), the words of the progress line, the log and `ops.status` checked."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from nats.js import JetStreamContext

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.membership import Membership, live_members
from bus.publisher import Publisher
from bus.runtime import publish_config
from bus.topology import (
    BATCHES,
    PROMPTS,
    REWARDS,
    TRAJECTORIES,
    WEIGHTS,
    Topology,
    drop_key,
    metrics_key,
)
from producers.gate import Producer
from producers.launcher import attach_bootstrap, progress
from producers.stall import stalled_line
from schemas import BatchEvent, Tensor, WeightVersionEvent
from schemas.config import ConfigError, RunConfig, load_config, parse_config
from schemas.kv_records import StepMetrics
from tests.helpers import prompt, reward, trajectory

ROOT = Path(__file__).resolve().parent.parent
SHORT = 1.0
"""stall_after in these tests: a second with no step is a stall."""


def config(run: str, tmp_path: Path | None = None, steps: int = 5, **data: object) -> RunConfig:
    """2 prompts x 2 samples a step, staleness 1: the gate admits 4 prompts at v0."""
    raw: dict[str, Any] = {
        "run": run,
        "data": {"n": 2, **data},
        "algorithm": {"prompts_per_step": 2, "max_staleness": 1},
        "trainer": {"steps": steps, "stall_after": SHORT},
    }
    if (
        tmp_path is not None
    ):  # a path, so the producer builds no model: nothing here generates or trains
        raw["model"] = {"path": str(tmp_path / "no-model")}
        raw["trainer"] |= {"checkpoint_dir": str(tmp_path / "checkpoints")}
    return parse_config(raw)


async def declare(js: JetStreamContext, topology: Topology, cfg: RunConfig) -> None:
    await topology.apply(js)
    await publish_config(await js.key_value(topology.kv_bucket), cfg)


async def record_steps(js: JetStreamContext, topology: Topology, steps: int, age: float) -> None:
    """What the trainer records after each step, the last one `age` seconds ago."""
    kv = await js.key_value(topology.kv_bucket)
    for step in range(steps):
        record = StepMetrics(
            step=step,
            time=time.time() - age,
            train_seconds=0.1,
            samples=0,
            reward_mean=0.0,
            staleness_max=0,
            staleness_hist=[],
            sample_ids=[],
        )
        await kv.put(metrics_key(0, step), record.encode())


def micro_batch(run: str, step: int, index: int, count: int) -> BatchEvent:
    rows, tokens = 2, 4
    zeros = np.zeros((rows, tokens), np.float32)
    return BatchEvent(
        id=f"{run}/step/{step}/0/{index}",
        run=run,
        step=step,
        dp_rank=0,
        dp_size=1,
        micro_index=index,
        micro_count=count,
        input_ids=Tensor.from_numpy(np.zeros((rows, tokens), np.int32)),
        attention_mask=Tensor.from_numpy(np.ones((rows, tokens), np.uint8)),
        loss_mask=Tensor.from_numpy(np.ones((rows, tokens), np.uint8)),
        advantages=Tensor.from_numpy(np.zeros(rows, np.float32)),
        behaviour_logprobs=Tensor.from_numpy(zeros),
        versions=Tensor.from_numpy(np.full((rows, tokens), step, np.int32)),
        rewards=Tensor.from_numpy(np.zeros(rows, np.float32)),
        sample_ids=tuple(f"{run}/{step}/{index}/{i}" for i in range(rows)),
    )


def weights(run: str, version: int) -> WeightVersionEvent:
    return WeightVersionEvent(
        id=f"{run}/weights/{version}",
        run=run,
        version=version,
        step=version,
        location="unused",
        manifest=(),
        total_bytes=0,
    )


def status_stall_line(url: str, topology: Topology) -> str:
    """The STALLED line of `python -m ops.status` for the run ('' if it prints none)."""
    done = subprocess.run(
        [sys.executable, "-m", "ops.status", "--run", topology.run, "--nats", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return next((line for line in done.stdout.splitlines() if line.startswith("STALLED")), "")


def test_stall_after_defaults_to_30s_and_is_checked() -> None:
    assert RunConfig().trainer.stall_after == 30.0
    assert load_config(ROOT / "examples" / "digits.yaml").trainer.stall_after == 30.0
    with pytest.raises(ConfigError, match=r"trainer\.stall_after: Input should be greater than 0"):
        parse_config({"trainer": {"stall_after": 0}})


def test_the_progress_line_uses_the_default_and_names_a_missing_trainer(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """A run whose config leaves stall_after out: quiet 25 s after the start, stalled 40 s after."""
    cfg = RunConfig(run=topology.run)

    async def first_line(producer: Producer, started: float) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            lines = asyncio.create_task(progress(producer, started, every=0.1))
            deadline = time.monotonic() + 30
            while "\n" not in out.getvalue() and time.monotonic() < deadline and not lines.done():
                await asyncio.sleep(0.05)
            lines.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lines
        assert "\n" in out.getvalue(), "no progress line within 30 s"
        return out.getvalue().splitlines()[0]

    async def scenario() -> tuple[str, str]:
        rt = await attach_bootstrap(cfg, nats_server.url)
        try:
            producer = Producer(rt)
            return await first_line(producer, time.time() - 25), await first_line(
                producer, time.time() - 40
            )
        finally:
            await rt.close()

    quiet, stalled = asyncio.run(scenario())
    assert "STALLED" not in quiet, f"stalled before the default 30 s: {quiet}"
    match = re.search(r"STALLED (\d+)s: (.*)$", stalled)
    assert match, f"no STALLED 40 s after the start with the default stall_after: {stalled}"
    assert 40 <= int(match.group(1)) < 60, stalled
    reasons = match.group(2).split("; ")
    assert "no live trainer: the run cannot progress until one joins" in reasons, stalled
    assert not any(r.startswith("no live producer") for r in reasons), (
        f"the producer is live: {stalled}"
    )


@pytest.mark.timeout(180)
def test_a_producer_alone_names_its_gate_and_every_missing_role_once_in_the_log(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    """The main job with no fleet: the gate fills to its limit at v0 and nothing moves."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config(topology.run, tmp_path).model_dump(mode="json")))
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "producers.prompts",
            "--config",
            str(path),
            "--nats",
            nats_server.url,
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    expected = [
        "no live rollout worker: the run cannot progress until one joins "
        "(4 prompts wait in its queue)",
        "no live reward worker: the run cannot progress until one joins",
        "no live buffer: the run cannot progress until one joins",
        "no live trainer: the run cannot progress until one joins",
        (
            "trainer at step 0 waits for the buffer to form step 0 (it holds 0 scored samples, "
            "a step needs 2 complete groups of 2)"
        ),
        "the gate has issued all 4 prompts it admits at weights v0 and waits for v1",
    ]
    full: list[str] = []
    lines: list[str] = []
    try:
        assert job.stdout is not None
        deadline = time.monotonic() + 120
        while len(full) < 3 and time.monotonic() < deadline:
            lines.append(line := job.stdout.readline())
            assert line, f"the job ended: {job.wait()} {job.stderr.read() if job.stderr else ''}"
            if (match := re.search(r"STALLED \d+s: (.*)$", line)) and match.group(1).split(
                "; "
            ) == expected:
                full.append(line)
        assert len(full) == 3, (
            f"no 3 progress lines naming {expected} within 120 s; the last:\n{''.join(lines[-3:])}"
        )
        first = int(re.search(r"STALLED (\d+)s", full[0]).group(1))  # type: ignore[union-attr]
        assert first < 20, (
            f"stalled for {first} s before it was named, with stall_after {SHORT} s: {full[0]}"
        )
    finally:
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=60)
    for reason in expected:
        logged = [
            line for line in stderr.splitlines() if "WARNING" in line and line.endswith(reason)
        ]
        assert len(logged) == 1, (
            f"{reason!r} logged {len(logged)} times over 3 stalled lines, not once:\n{stderr}"
        )


def test_status_names_the_micro_batch_the_trainer_waits_for(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """Steps 0-1 recorded, step 1 stored whole, step 2 stored in part
    (micro-batches 0 and 2 of 3)."""

    async def scenario() -> tuple[str, str | None]:
        nc = await connect(nats_server.url, "test")
        js = nc.jetstream()
        try:
            await declare(js, topology, config(topology.run))
            await record_steps(js, topology, 2, age=5)
            publisher, run = Publisher(js, topology), topology.run
            for batch in (
                micro_batch(run, 1, 0, 2),
                micro_batch(run, 1, 1, 2),
                micro_batch(run, 2, 0, 3),
            ):
                await publisher.publish(BATCHES, batch, 0)
            await js.publish(topology.subject(BATCHES, 0), b"not a batch")
            await publisher.publish(BATCHES, micro_batch(run, 2, 2, 3), 0)
            trainer = await Membership.join(js, topology, "trainer")
            trainer.report(engine="torch", weight_version=2)
            partial = await asyncio.to_thread(status_stall_line, nats_server.url, topology)
            await publisher.publish(BATCHES, micro_batch(run, 2, 1, 3), 0)
            whole = await stalled_line(js, topology)
            await trainer.leave()
            return partial, whole
        finally:
            await nc.close()

    partial, whole = asyncio.run(scenario())
    assert partial.startswith("STALLED "), (
        f"ops.status shows no stall 5 s after the last step:\n{partial}"
    )
    reasons = partial.split(": ", 1)[1].split("; ")
    assert (
        "trainer at step 2 has 2 of 3 micro-batches of step 2, waiting for micro-batch 1" in reasons
    ), partial
    assert not any("no live trainer" in r for r in reasons), f"the trainer is live: {partial}"
    assert (
        whole is not None
        and whole.startswith("TRAINING ")
        and "trainer at step 2 has all 3 micro-batches of step 2 and is training it" in whole
    ), f"a live trainer holding its whole step is shown as training, not stalled: {whole}"


def test_status_names_the_gate_and_a_buffer_holding_samples_with_no_member(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """Gate figures from the bus alone (prompts stored, latest weights, drop records); the
    buffer's queue with samples in flight and no buffer heartbeating."""

    async def scenario() -> list[str | None]:
        nc = await connect(nats_server.url, "test")
        js = nc.jetstream()
        try:
            cfg = config(topology.run)
            await declare(js, topology, cfg)
            await record_steps(js, topology, 1, age=5)
            publisher, run = Publisher(js, topology), topology.run
            await publisher.publish(WEIGHTS, weights(run, 1))
            for i in range(6):  # (v1 + staleness 1 + 1) * 2 prompts a step
                await publisher.publish(PROMPTS, prompt(run, i))
            for sample in range(3):
                await publisher.publish(REWARDS, reward(run, prompt_index=0, sample=sample))
            held = await js.pull_subscribe_bind(
                REWARDS.work_queue.durable, stream=topology.stream(REWARDS)
            )
            assert (
                len(await held.fetch(3, timeout=5)) == 3
            )  # taken, never acked: a buffer that vanished
            lines = [await stalled_line(js, topology)]
            kv = await js.key_value(topology.kv_bucket)
            await kv.put(drop_key(f"{run}/0/1"), b"all 2 rewards equal (1)")
            lines.append(await stalled_line(js, topology))  # one replacement admitted, not issued
            await publisher.publish(PROMPTS, prompt(run, 6))
            lines.append(await stalled_line(js, topology))
            await publish_config(
                kv, cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"steps": 3})})
            )
            lines.append(
                await stalled_line(js, topology)
            )  # 7 = all 3 steps' prompts + the replacement
            return lines
        finally:
            await nc.close()

    at_limit, one_dropped, replaced, at_the_end = asyncio.run(scenario())
    assert at_limit is not None, "no stall 5 s after the last step"
    assert (
        "the gate has issued all 6 prompts it admits at weights v1 and waits for v2" in at_limit
    ), at_limit
    assert (
        "the buffer queue holds 3 scored samples in flight for a buffer that stopped heartbeating "
        "(no live buffer), back to the queue 10s after its last heartbeat"
    ) in at_limit, at_limit
    assert (
        "trainer at step 1 waits for the buffer to form step 1 (it holds 3 scored samples"
        in at_limit
    ), at_limit
    assert one_dropped is not None and "the gate" not in one_dropped, (
        f"the gate is open after a drop: {one_dropped}"
    )
    assert (
        replaced is not None
        and "the gate has issued all 7 prompts it admits at weights v1 and waits for v2" in replaced
    )
    assert at_the_end is not None and "the gate" not in at_the_end, (
        f"the gate has issued the whole run: {at_the_end}"
    )


@pytest.mark.timeout(180)
def test_a_stuck_then_stopped_reward_worker_is_named_with_the_trajectories_it_holds(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """A real reward worker whose reward function hangs holds 3 trajectories; SIGSTOPped, its
    heartbeat expires (member TTL 2 s here) and the trajectories stay in flight."""
    topology = Topology(run=f"stall{os.getpid()}{int(time.time()) % 100000}", member_ttl=2.0)
    reward_cfg = config(topology.run, reward="tests.reward_fns:hang")
    reward_cfg = reward_cfg.model_copy(
        update={"reward": reward_cfg.reward.model_copy(update={"timeout": 600.0})}
    )

    async def setup() -> None:
        nc = await connect(nats_server.url, "test")
        js = nc.jetstream()
        await declare(js, topology, reward_cfg)
        await record_steps(js, topology, 1, age=5)
        for sample in range(3):
            await Publisher(js, topology).publish(TRAJECTORIES, trajectory(topology.run, 0, sample))
        await nc.close()

    async def wait_then_line(what: str, holds: object) -> str:
        """The stall line once `holds(queue info, live roles)` is true (within 60 s)."""
        nc = await connect(nats_server.url, "test")
        js = nc.jetstream()
        try:
            deadline = time.monotonic() + 60
            while True:
                info = await js.consumer_info(
                    topology.stream(TRAJECTORIES), TRAJECTORIES.work_queue.durable
                )
                roles = {m.role for m in await live_members(js, topology)}
                if holds(info, roles):  # type: ignore[operator]
                    break
                assert time.monotonic() < deadline, (
                    f"{what} within 60 s: in flight {info.num_ack_pending}, live {roles}"
                )
                await asyncio.sleep(0.2)
            await asyncio.sleep(SHORT + 0.5)  # past stall_after with no ack
            line = await stalled_line(js, topology)
            assert line is not None, "no stall 5 s after the last step"
            return line
        finally:
            await nc.close()

    asyncio.run(setup())
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "consumers.reward",
            "--run",
            topology.run,
            "--nats",
            nats_server.url,
        ],
        cwd=ROOT,
        stderr=open(tmp_path / "reward.log", "wb"),
    )  # noqa: SIM115
    try:
        stuck = asyncio.run(
            wait_then_line(
                "the reward worker took the 3 trajectories",
                lambda info, roles: (
                    info.num_ack_pending == 3 and info.num_pending == 0 and "reward" in roles
                ),
            )
        )
        worker.send_signal(signal.SIGSTOP)
        stopped = asyncio.run(
            wait_then_line(
                "the stopped reward worker's heartbeat expired",
                lambda info, roles: "reward" not in roles,
            )
        )
    finally:
        worker.kill()
        worker.wait()
    assert (
        "the reward queue has 3 trajectories in flight at 1 live reward worker and none acked for "
        "over 1s"
    ) in stuck, stuck
    assert "no live reward worker" not in stuck, stuck
    assert (
        "the reward queue holds 3 trajectories in flight for a reward worker that stopped "
        "heartbeating (no live reward worker), back to the queue 10s after its last heartbeat"
    ) in stopped, stopped
    assert "no live reward worker: the run cannot progress until one joins" in stopped, stopped
