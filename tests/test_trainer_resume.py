"""A trainer killed and restarted from its checkpoint continues from the next batch in the stream.

One recorded batch stream (the buffer's own `publish_step` over seeded scored samples) is
stored under two runs. Trainer A trains it uninterrupted. Trainer B gets the first KILL_AFTER
steps, is SIGKILLed once it has trained them (its last checkpoint is CHECKPOINT_EVERY steps
in, so it has trained steps beyond it that die with it), gets the rest, and is restarted.
Both runs' per-step losses (KV `metrics.0.<step>`) must match to float tolerance: the
restarted trainer retrained from the checkpoint on exactly the batches after it, with the
same model, optimizer and RNG state. Deterministic: same seeds, one torch thread, no rollout.
With `algorithm.advantage: gae` the critic and its optimizer must come back too: the policy's
advantages and the value loss of every retrained step depend on them.

Retention (issue 15): after each committed checkpoint but the run's last, the trainer deletes
the batches no restart can need. At B's kill and at both runs' end the batch stream must hold
exactly the last trimming checkpoint's last step and what follows it: every batch after the
checkpoint's last sequence (what B's restart reads, and it then resumes exactly), and the
last step whole (what a restarted buffer learns its next step from).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError

from bus.embedded import EmbeddedNats
from bus.runtime import Runtime
from bus.topology import BATCHES, metrics_key
from consumers.buffer import BatchedSoFar, Buffer, Group, read_batches
from consumers.update_history import UpdateHistory
from engines.tiny import build_tiny_model
from producers.launcher import attach_bootstrap
from producers.tasks import VOCAB
from schemas import BatchEvent, RewardEvent, Tensor, TrajectoryEvent, decode
from schemas.config import RunConfig

ROOT = Path(__file__).resolve().parent.parent
STEPS, CHECKPOINT_EVERY, KILL_AFTER = 8, 3, 5
"""B is killed after step index 4: its checkpoint holds 3 steps, steps 3 and 4 are retrained."""
PROMPTS_PER_STEP, GROUP = 2, 4
MICRO = 2
"""Micro-batches a step (64 tokens each at most): step s is stored at sequences 2s+1 and 2s+2."""


def steps_of(first: int, last: int) -> list[tuple[int, int]]:
    """(sequence, step) of every micro-batch of steps first .. last, as `record` stores them."""
    return [(MICRO * step + i + 1, step) for step in range(first, last + 1) for i in range(MICRO)]


def run_config(run: str, model: Path, checkpoints: Path, advantage: str = "grpo") -> RunConfig:
    return RunConfig.model_validate({
        "run": run, "model": {"path": str(model)}, "data": {"n": GROUP},
        "algorithm": {"prompts_per_step": PROMPTS_PER_STEP, "advantage": advantage},
        # 64 tokens: two micro-batches a step, so the restart also re-assembles steps.
        "trainer": {"steps": STEPS, "checkpoint_every": CHECKPOINT_EVERY, "micro_batch_tokens": 64,
                    "checkpoint_dir": str(checkpoints)},
    })


def scored_group(run: str, step: int, prompt: int, rng: np.random.Generator, vocab: int) -> Group:
    """One prompt's GROUP scored samples; the same `rng` state gives the same samples in any run."""
    prompt_id = f"{run}/0/{step * PROMPTS_PER_STEP + prompt}"
    group = Group(prompt_id, GROUP)
    prompt_ids = rng.integers(1, vocab, size=5).astype(np.int32)
    for index in range(GROUP):
        response = rng.integers(1, vocab, size=int(rng.integers(2, 7))).astype(np.int32)
        trajectory = TrajectoryEvent(
            id=f"{prompt_id}/{index}", run=run, prompt_id=prompt_id, sample_index=index, group_size=GROUP,
            prompt_ids=Tensor.from_numpy(prompt_ids), response_ids=Tensor.from_numpy(response),
            # A random-init model is near uniform: behaviour log-probs near log(1/V) keep ratios
            # near 1.
            logprobs=Tensor.from_numpy(np.full(len(response), -np.log(vocab), np.float32)),
            versions=Tensor.from_numpy(np.zeros(len(response), np.int32)), response_text="", task={},
        )
        reward = RewardEvent(id=trajectory.id, run=run, trajectory=trajectory, reward=float(rng.random()))
        group.samples[index] = (reward, Msg(_client=None))  # type: ignore[arg-type]  # only its headers are read
    return group


async def record(rt: Runtime, steps: range, vocab: int) -> None:
    """Publish `steps` of the stream as the buffer would, from samples seeded by step."""
    buffer = Buffer(rt, BatchedSoFar())
    for step in steps:
        rng = np.random.default_rng(step)
        await buffer.publish_step(step, [scored_group(rt.topology.run, step, p, rng, vocab) for p in range(PROMPTS_PER_STEP)])


async def stored(rt: Runtime) -> list[tuple[int, int]]:
    """(sequence, step) of every batch still in the run's stream, in order."""
    count = (await rt.js.stream_info(rt.topology.stream(BATCHES))).state.messages
    sub = await rt.js.subscribe(rt.topology.subject(BATCHES, ">"), ordered_consumer=True)
    try:
        msgs = [await sub.next_msg(timeout=10) for _ in range(count)]
    finally:
        await sub.unsubscribe()
    return [(m.metadata.sequence.stream, decode(m.data, BatchEvent).step) for m in msgs]


def trainer(url: str, run: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "consumers.trainer", "--run", run, "--nats", url],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


async def metrics(rt: Runtime, step: int) -> dict | None:
    try:
        entry = await rt.kv.get(metrics_key(0, step))
    except KeyNotFoundError:
        return None
    return json.loads(entry.value or b"")


async def wait_for_step(rt: Runtime, step: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while await metrics(rt, step) is None:
        assert proc.poll() is None and time.monotonic() < deadline, f"{rt.topology.run}: no step {step}"
        await asyncio.sleep(0.1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_restarted_trainer_continues_from_the_next_batch(nats_server: EmbeddedNats, tmp_path: Path, advantage: str) -> None:
    model = build_tiny_model(tmp_path / "model", VOCAB, seed=0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    runs = {name: f"resume-{name}-{uuid.uuid4().hex[:8]}" for name in ("a", "b")}

    Stored = list[tuple[int, int]]

    async def scenario() -> tuple[dict[str, list[dict]], float, dict, Stored, dict[str, Stored], BatchedSoFar]:
        # Declared and configured as the producer does it; the runtime publishes the batches.
        rts = {name: await attach_bootstrap(run_config(run, model, tmp_path / name, advantage), nats_server.url)
               for name, run in runs.items()}
        await record(rts["a"], range(STEPS), vocab)
        await record(rts["b"], range(KILL_AFTER), vocab)
        procs = {name: trainer(nats_server.url, run, tmp_path / f"{name}.log") for name, run in runs.items()}
        try:
            await wait_for_step(rts["b"], KILL_AFTER - 1, procs["b"])
            procs["b"].send_signal(signal.SIGKILL)
            procs["b"].wait()
            killed_at = time.time()
            # B's checkpoint (3 steps: its last sequence is step 2's last) is in force: steps 0
            # and 1 are gone; step 2 stays for the buffer, steps 3 and 4 for B's restart.
            checkpoint = torch.load(tmp_path / "b" / "rank0.pt", weights_only=True)
            assert checkpoint["extra"]["last_seq"] == steps_of(0, CHECKPOINT_EVERY - 1)[-1][0]
            at_kill = await stored(rts["b"])
            await record(rts["b"], range(KILL_AFTER, STEPS), vocab)
            procs["b"] = trainer(nats_server.url, runs["b"], tmp_path / "b.log")
            for name, proc in procs.items():
                assert await asyncio.to_thread(proc.wait, 90) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
        curves = {name: [await metrics(rt, step) for step in range(STEPS)] for name, rt in rts.items()}
        history = torch.load(tmp_path / "b" / "rank0.pt", weights_only=True)["extra"]["history"]
        at_end = {name: await stored(rt) for name, rt in rts.items()}
        replayed = await read_batches(rts["a"])
        for rt in rts.values():
            await rt.close()
        # Every step was recorded (both runs finished); a missing one fails the checks below.
        return cast(dict[str, list[dict]], curves), killed_at, history, at_kill, at_end, replayed

    curves, killed_at, history, at_kill, at_end, replayed = asyncio.run(scenario())
    assert at_kill == steps_of(CHECKPOINT_EVERY - 1, KILL_AFTER - 1), (
        f"at B's kill the stream held (sequence, step) {at_kill}: "
        "the checkpoint's last step and every batch after it must stay, nothing before"
    )
    # The run's end trims nothing: what the last checkpoint before it (6 steps) kept stays,
    # in both runs.
    last_trim = (STEPS - 1) // CHECKPOINT_EVERY * CHECKPOINT_EVERY  # 6
    for name, kept in at_end.items():
        assert kept == steps_of(last_trim - 1, STEPS - 1), f"{name}: at the end the stream held {kept}"
    # A buffer restarted now learns the next step from what is left, not step 0,
    # and no step half stored.
    assert (replayed.next_step, replayed.partial) == (STEPS, None), (replayed.next_step, replayed.partial)
    a, b = curves["a"], curves["b"]
    # Steps inside B's checkpoint were trained once, before the kill; the rest after it.
    assert [m["time"] < killed_at for m in b] == [step < CHECKPOINT_EVERY for step in range(STEPS)]
    np.testing.assert_allclose([m["loss"] for m in b], [m["loss"] for m in a], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose([m["grad_norm"] for m in b], [m["grad_norm"] for m in a], rtol=1e-5)
    if advantage == "gae":
        for name in ("value_loss", "value_mean", "critic_grad_norm"):
            np.testing.assert_allclose([m[name] for m in b], [m[name] for m in a], rtol=1e-5, atol=1e-7, err_msg=name)
        assert b[-1]["value_mean"] != 0.0, "the critic trained"
    # The final model's update history holds every sample of the stream once, in order: the
    # checkpoint's hash chain is that of the steps' own records, and those hold no repeat.
    assert UpdateHistory.from_dict(history) == UpdateHistory.of_steps([m["sample_ids"] for m in b])
    trained = [sid for m in b for sid in m["sample_ids"]]
    assert len(set(trained)) == len(trained) == STEPS * PROMPTS_PER_STEP * GROUP
    assert set(history) == {"steps", "samples", "digest"}, "the checkpoint keeps no list that grows with the run"

